"""The lab networks: bridges on the machine, one network namespace per host.

- ``dglab0`` (10.213.0.0/24): the lab network; the machine is 10.213.0.1 on it
  (the registry and the hub listen there).
- ``dglab1`` (10.213.1.0/24): a private network, like a server room behind a
  bastion. The machine has no address on it and no route to it. Its hosts go
  out through a NAT router (its own namespace, masquerading onto the lab
  network), as a datacenter's hosts reach the internet; people come in through
  bastion01, the one host on both networks. From there they reach the uplink's
  registry and hub ports, nothing else of the machine (a relay on the control
  machine, for one, is out of their reach).
"""
from __future__ import annotations

from pathlib import Path

from . import config, sh

BRIDGES = {"lab": config.BRIDGE, "private": config.PRIVATE_BRIDGE}


def _bridge(name: str, address: str | None):
    if not sh.ok("ip", "link", "show", name):
        sh.run("ip", "link", "add", name, "type", "bridge")
    if address:
        addrs = sh.run("ip", "-4", "-o", "addr", "show", "dev", name).stdout
        if f"{address}/" not in addrs:
            sh.run("ip", "addr", "add", f"{address}/{config.PREFIX}", "dev", name)
    sh.run("ip", "link", "set", name, "up")


def ensure_bridge():
    _bridge(config.BRIDGE, config.GATEWAY)
    _bridge(config.PRIVATE_BRIDGE, None)  # no address: no route from this machine
    # and no way around: this machine's default route would carry the private network's
    # addresses out to whatever network it sits on (which may answer anything)
    private = f"{config.PRIVATE_SUBNET}.0/{config.PREFIX}"
    if "unreachable" not in sh.run("ip", "route", "show", private).stdout:
        sh.run("ip", "route", "add", "unreachable", private)
    _ensure_nat_router()


def _ensure_nat_router():
    """The private network's way out: forwarding and masquerading in a namespace."""
    ns = config.NAT_NETNS
    if not Path(f"/run/netns/{ns}").exists():
        sh.run("ip", "netns", "add", ns)
    for side, bridge, address, peer in (("0", config.BRIDGE, config.NAT_OUTSIDE, "out"),
                                        ("1", config.PRIVATE_BRIDGE, config.PRIVATE_GATEWAY, "in")):
        veth = f"dglnat{side}"
        if not sh.ok("ip", "link", "show", veth):
            sh.run("ip", "link", "add", veth, "type", "veth", "peer", "name", peer, "netns", ns)
        sh.run("ip", "link", "set", veth, "master", bridge, "up")
        addrs = sh.run("ip", "-n", ns, "-4", "-o", "addr", "show", "dev", peer).stdout
        if f"{address}/" not in addrs:
            sh.run("ip", "-n", ns, "addr", "add", f"{address}/{config.PREFIX}", "dev", peer)
        sh.run("ip", "-n", ns, "link", "set", peer, "up")
    sh.run("ip", "-n", ns, "link", "set", "lo", "up")
    sh.run("ip", "netns", "exec", ns, "sysctl", "-q", "-w", "net.ipv4.ip_forward=1")
    rule = ["-s", f"{config.PRIVATE_SUBNET}.0/{config.PREFIX}", "-o", "out", "-j", "MASQUERADE"]
    if not sh.ok("ip", "netns", "exec", ns, "iptables", "-t", "nat", "-C", "POSTROUTING", *rule):
        sh.run("ip", "netns", "exec", ns, "iptables", "-t", "nat", "-A", "POSTROUTING", *rule)
    # as a data centre's private network: out to the mirrors (the uplink), not to the
    # control machine's other ports (the run's artifact relay among them)
    closed = ["-s", f"{config.PRIVATE_SUBNET}.0/{config.PREFIX}", "-d", config.GATEWAY, "-p", "tcp",
              "-m", "conntrack", "--ctstate", "NEW", "-m", "multiport", "!", "--dports",
              f"{config.REGISTRY_PORT},{config.HUB_PORT}", "-j", "REJECT", "--reject-with", "tcp-reset"]
    if not sh.ok("ip", "netns", "exec", ns, "iptables", "-C", "FORWARD", *closed):
        sh.run("ip", "netns", "exec", ns, "iptables", "-A", "FORWARD", *closed)


def ensure_host(host: config.LabHost):
    if not Path(f"/run/netns/{host.netns}").exists():
        sh.run("ip", "netns", "add", host.netns)
    ns = ("ip", "-n", host.netns)
    # a lab of an earlier layout may have put this host on another network: its links go first
    expected = {host.veth_on(n) for n in host.networks}
    for network in BRIDGES:
        veth = host.veth_on(network)
        if veth not in expected and sh.ok("ip", "link", "show", veth):
            sh.run("ip", "link", "del", veth)
    for number, network in enumerate(host.networks):
        if not sh.ok("ip", "link", "show", host.veth_on(network)) and sh.ok(*ns, "link", "show", f"host{number}"):
            sh.run(*ns, "link", "del", f"host{number}")
    for number, network in enumerate(host.networks):
        veth, inside, address = host.veth_on(network), f"host{number}", host.address_on(network)
        if not sh.ok("ip", "link", "show", veth):
            sh.run("ip", "link", "add", veth, "type", "veth", "peer", "name", inside, "netns", host.netns)
            forget_neighbour(address)
        sh.run("ip", "link", "set", veth, "master", BRIDGES[network], "up")
        addrs = sh.run(*ns, "-4", "-o", "addr", "show", "dev", inside).stdout
        if f"{address}/" not in addrs:
            sh.run(*ns, "addr", "add", f"{address}/{config.PREFIX}", "dev", inside)
        sh.run(*ns, "link", "set", inside, "up")
    sh.run(*ns, "link", "set", "lo", "up")
    routes = sh.run(*ns, "route", "show", "default").stdout
    if "default" not in routes:
        # the lab network's hosts go out through this machine; the private network's through its NAT router
        via = config.GATEWAY if host.networks[0] == "lab" else config.PRIVATE_GATEWAY
        sh.run(*ns, "route", "add", "default", "via", via)


def power_lost(host: config.LabHost):
    """What a host's power cut does to its network, beside its processes: its links go dark, and
    what its software had added to them (an address keepalived held) is gone, as it is from a
    real machine that boots again. The namespace outlives the processes here: left alone, it
    would still answer ARP for such an address and refuse connections to it. `ensure_host`
    (lab.up) lights the links again."""
    ns = ("ip", "-n", host.netns)
    for number, network in enumerate(host.networks):
        if sh.ok("ip", "link", "show", host.veth_on(network)):
            sh.run("ip", "link", "set", host.veth_on(network), "down")
        inside, own = f"host{number}", host.address_on(network)
        for line in sh.run(*ns, "-4", "-o", "addr", "show", "dev", inside, check=False).stdout.splitlines():
            fields = line.split()
            added = fields[fields.index("inet") + 1] if "inet" in fields else ""
            if added and not added.startswith(f"{own}/"):
                sh.run(*ns, "addr", "del", added, "dev", inside, check=False)


def forget_neighbour(address: str):
    """A new link has a new MAC address: this machine (and the NAT router, for the private
    network) forget the one they knew at ``address``. Called where a host's link is made, the
    one place its MAC changes. An entry of an earlier host there is never dropped on its own
    while the table is small (the kernel's gc_thresh1): this machine kept sending to the old
    MAC, its unicast probes went unanswered for ~8 s, and a deploy's 10 s connect timed out on
    all four scale nodes of a lab that had had nodes before."""
    sh.run("ip", "neigh", "flush", "to", address, check=False)
    if Path(f"/run/netns/{config.NAT_NETNS}").exists():
        sh.run("ip", "-n", config.NAT_NETNS, "neigh", "flush", "to", address, check=False)


def remove_host(host: config.LabHost):
    for network in host.networks:
        if sh.ok("ip", "link", "show", host.veth_on(network)):
            sh.run("ip", "link", "del", host.veth_on(network), check=False)
    if Path(f"/run/netns/{host.netns}").exists():
        sh.run("ip", "netns", "del", host.netns, check=False)


def remove_bridge():
    for veth in ("dglnat0", "dglnat1"):
        if sh.ok("ip", "link", "show", veth):
            sh.run("ip", "link", "del", veth, check=False)
    if Path(f"/run/netns/{config.NAT_NETNS}").exists():
        sh.run("ip", "netns", "del", config.NAT_NETNS, check=False)
    for bridge in BRIDGES.values():
        if sh.ok("ip", "link", "show", bridge):
            sh.run("ip", "link", "del", bridge, check=False)
    sh.run("ip", "route", "del", "unreachable", f"{config.PRIVATE_SUBNET}.0/{config.PREFIX}", check=False)


def leftovers() -> list[str]:
    """Lab namespaces and links still present (for lab.down's own check and tests)."""
    found = []
    for line in sh.run("ip", "netns", "list", check=False).stdout.splitlines():
        if line.split(" ")[0].startswith("dglab-"):
            found.append(f"network namespace {line.split(' ')[0]}")
    for line in sh.run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name in BRIDGES.values() or (name.startswith("dgl") and (name[3:].isdigit() or name[3:4] in "pn")):
            found.append(f"link {name}")
    if "unreachable" in sh.run("ip", "route", "show", f"{config.PRIVATE_SUBNET}.0/{config.PREFIX}", check=False).stdout:
        found.append(f"route unreachable {config.PRIVATE_SUBNET}.0/{config.PREFIX}")
    return found
