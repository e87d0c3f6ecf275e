"""The lab network: a bridge on the machine and one network namespace per host."""
from __future__ import annotations

from pathlib import Path

from . import config, sh


def ensure_bridge():
    if not sh.ok("ip", "link", "show", config.BRIDGE):
        sh.run("ip", "link", "add", config.BRIDGE, "type", "bridge")
    addrs = sh.run("ip", "-4", "-o", "addr", "show", "dev", config.BRIDGE).stdout
    if f"{config.GATEWAY}/" not in addrs:
        sh.run("ip", "addr", "add", f"{config.GATEWAY}/{config.PREFIX}", "dev", config.BRIDGE)
    sh.run("ip", "link", "set", config.BRIDGE, "up")


def ensure_host(host: config.LabHost):
    if not Path(f"/run/netns/{host.netns}").exists():
        sh.run("ip", "netns", "add", host.netns)
    if not sh.ok("ip", "link", "show", host.veth):
        sh.run("ip", "link", "add", host.veth, "type", "veth", "peer", "name", "host0", "netns", host.netns)
    sh.run("ip", "link", "set", host.veth, "master", config.BRIDGE, "up")
    ns = ("ip", "-n", host.netns)
    addrs = sh.run(*ns, "-4", "-o", "addr", "show", "dev", "host0").stdout
    if f"{host.address}/" not in addrs:
        sh.run(*ns, "addr", "add", f"{host.address}/{config.PREFIX}", "dev", "host0")
    sh.run(*ns, "link", "set", "lo", "up")
    sh.run(*ns, "link", "set", "host0", "up")
    routes = sh.run(*ns, "route", "show", "default").stdout
    if "default" not in routes:
        sh.run(*ns, "route", "add", "default", "via", config.GATEWAY)


def remove_host(host: config.LabHost):
    if sh.ok("ip", "link", "show", host.veth):
        sh.run("ip", "link", "del", host.veth, check=False)
    if Path(f"/run/netns/{host.netns}").exists():
        sh.run("ip", "netns", "del", host.netns, check=False)


def remove_bridge():
    if sh.ok("ip", "link", "show", config.BRIDGE):
        sh.run("ip", "link", "del", config.BRIDGE, check=False)


def leftovers() -> list[str]:
    """Lab namespaces and links still present (for lab.down's own check and tests)."""
    found = []
    for line in sh.run("ip", "netns", "list", check=False).stdout.splitlines():
        if line.split(" ")[0].startswith("dglab-"):
            found.append(f"network namespace {line.split(' ')[0]}")
    for line in sh.run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name == config.BRIDGE or (name.startswith("dgl") and name[3:].isdigit()):
            found.append(f"link {name}")
    return found
