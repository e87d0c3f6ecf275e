"""shared address: on the hosts of the group `gateway`, the fleet's one address
(`gateway_address`), held by one of them at a time through VRRP (keepalived), moved
within about 4 s when its holder or the holder's link dies, and within about 2 s when
the holder's HAProxy stops answering. A gateway that comes back stays a backup
(nopreempt) unless `gateway_preempt` says otherwise.

keepalived is the distribution's package, run by its own systemd unit: it needs the
host's network (raw sockets, the address itself) and root, which a container would
only be handed anyway, and there is no maintained official image of it. Where it is
missing, apt-get or dnf installs it."""
from __future__ import annotations

import shlex
from pathlib import Path

from converge.changes import Check, Command, Decision, File, Role
from converge.facts import Fact
from converge.facts.host import Commands, FileState, OsRelease, UnitState

from serving.fleet import SHARED_ADDRESS_CHECK, SHARED_ADDRESS_CONF, SHARED_ADDRESS_MANAGED, is_gateway
from serving.haproxy.instance import GATEWAY
from serving.handoffs import KEEPALIVED

from serving.host_programs import RESULT_LIBRARY, Program, Protocol, ended
from serving.systemd import SYSTEMD_FILE, systemctl, systemd_parameters

from . import keepalived
from .keepalived import UNIT

FILES = Path(__file__).parent / "files"
ANSWERING = Protocol("the shared address answering", result={
    "state": "answers, or silent (not in time)", "code": "the HTTP status it answered",
    "holder": "yes when this gateway holds the address"}, exits={"silent": 3})
ANSWERING_PROGRAM = Program((SYSTEMD_FILE, RESULT_LIBRARY, FILES / "answering.sh"), ANSWERING)
INSTALL_PROGRAM = Program((FILES / "install.sh",))


class Ipv4Addresses(Fact):
    """The host's IPv4 addresses, by interface."""

    library, command = FILES / "facts.sh", "fact_ipv4_addresses"

    def process(self, output, rc):
        return keepalived.parse_addresses(output)


def facts(v):
    return {"ipv4_addresses": Ipv4Addresses(), "keepalived_commands": Commands("keepalived", "apt-get", "dnf"),
            "keepalived_conf": FileState(SHARED_ADDRESS_CONF), "keepalived_check": FileState(SHARED_ADDRESS_CHECK),
            "keepalived_unit": UnitState(UNIT), "os": OsRelease()}


def gateways(ctx) -> dict[str, str]:
    fleet = ctx.services.get("fleet")
    return {door.host: door.address for door in (fleet.gateways if fleet else ())}


def plan(ctx):
    v, f = ctx.vars, ctx.facts
    shared = v.get("gateway_address")
    if not shared:
        yield from _removal(ctx)
        return
    why = keepalived.valid_address(shared)
    if why:
        yield Check("gateway_address", ok=False, message=f"gateway_address: {why}: set an unused IPv4 address on the "
                                                         f"gateways' network")
        return
    if v.get("api_host", "0.0.0.0") != "0.0.0.0":
        yield Check("gateway listens on every address", ok=False,
                    message=f"api_host is {v['api_host']}: a gateway that shares gateway_address {shared} must listen "
                            f"on every address to answer there once the address moves to it; remove api_host for the "
                            f"group `gateway`")
        return
    addresses = f.get("ipv4_addresses") or []
    place = keepalived.placement(shared, addresses)
    if place is None:
        seen = ", ".join(f"{a['interface']} {a['address']}/{a['prefix']}" for a in addresses
                         if a["interface"] != "lo") or "none"
        yield Check("gateway_address on this host's network", ok=False,
                    message=f"gateway_address {shared} is on none of {ctx.name}'s networks ({seen}): pick an unused "
                            f"address on the network clients reach every gateway on")
        return
    yield from _install(ctx)
    port = int(v.get("api_port", 8000))
    files = [File("shared address check", path=SHARED_ADDRESS_CHECK, mode="0755",
                  content=keepalived.render_check(shlex.quote(ctx.name), port, f"{GATEWAY.dir}/ca.crt"),
                  current=f.get("keepalived_check")),
             File("keepalived configuration", path=SHARED_ADDRESS_CONF, mode="0644",
                  content=keepalived.render_config(ctx.name, v, place, gateways(ctx)),
                  current=f.get("keepalived_conf"))]
    yield Decision("configuration", produces=KEEPALIVED, value=files[1].sha256)
    changed = any(step.needed() for step in files)
    yield from files
    state = f.get("keepalived_unit") or {}
    if state.get("ActiveState") != "active":
        action, why = "restart", f"was {state.get('ActiveState', 'absent')}"
    elif changed:
        # keepalived reads its configuration again on SIGHUP and keeps the address where it is
        action, why = "reload", "its configuration changed"
    else:
        action, why = "none", "not enabled at boot"
    enabled = state.get("UnitFileState") == "enabled"
    wait = int(v.get("frontdoor_ready_timeout", 60))
    yield Command("shared address answering", when=action != "none" or not enabled,
                  script=ANSWERING_PROGRAM.script({**systemd_parameters(UNIT, action, enable=True),
                                                   "SHARED": shared, "URL": f"https://{shared}:{port}/health",
                                                   "CA_FILE": f"{GATEWAY.dir}/ca.crt", "TIMEOUT_S": wait}),
                  describe=f"systemctl {'start' if action == 'restart' else 'enable' if action == 'none' else action} "
                           f"{UNIT}; wait until https://{shared}:{port}/health answers ({why})",
                  timeout=wait + 30, interpret=_interpret(shared, port, wait))


def _interpret(shared: str, port: int, timeout: int):
    from converge.errors import StepFailed

    def interpret(result):
        said, _ = ended(ANSWERING, result, f"the shared address {shared}:{port}")
        if result.rc == 0 and said["state"] == "answers":
            code, holder = said["code"], said["holder"]
            return f"{shared}:{port} answers (HTTP {code}); {'held here' if holder == 'yes' else 'held by another gateway'}"
        raise StepFailed(f"the shared address {shared}:{port} did not answer within {timeout} s: "
                         f"`journalctl -u {UNIT}` on the gateways says why (another VRRP router with id "
                         f"gateway_vrrp_id on that network, VRRP blocked between the gateways, HAProxy not answering)")
    return interpret


def _install(ctx):
    found = ctx.facts.get("keepalived_commands") or {}
    if found.get("keepalived"):
        return
    tool = "apt-get" if found.get("apt-get") else "dnf" if found.get("dnf") else None
    if tool is None:
        os_name = (ctx.facts.get("os") or {}).get("PRETTY_NAME") or "this system"
        yield Check("keepalived installed", ok=False,
                    message=f"keepalived is not installed and {os_name} has neither apt-get nor dnf: install "
                            f"its keepalived package (NixOS: services.keepalived.enable), then deploy again")
        return
    yield Command("keepalived installed", script=INSTALL_PROGRAM.script({"TOOL": tool}),
                  describe=f"{tool} install keepalived (not installed)", timeout=900)


def _removal(ctx):
    """gateway_address taken out of the inventory: the address and our keepalived go."""
    conf = ctx.facts.get("keepalived_conf") or {}
    if not conf.get("content", "").startswith(SHARED_ADDRESS_MANAGED):
        return
    yield Command("shared address removed",
                  script=systemctl(UNIT, "remove", remove=(SHARED_ADDRESS_CONF, SHARED_ADDRESS_CHECK)),
                  describe=f"systemctl disable --now {UNIT}; remove {SHARED_ADDRESS_CONF} (gateway_address is no "
                           f"longer set)")


def summary(ctx) -> dict:
    shared = ctx.vars.get("gateway_address")
    if not shared or ctx.results.get(KEEPALIVED) is None:
        return {}
    return {"shared_address": {"address": shared, "unit": UNIT, "config": SHARED_ADDRESS_CONF,
                               "ca": f"{GATEWAY.dir}/ca.crt",
                               "config_sha256": ctx.results[KEEPALIVED], "gateways": list(gateways(ctx)),
                               "port": int(ctx.vars.get("api_port", 8000))}}


ROLE = Role("shared_address", facts, plan, summary=summary, hosts=is_gateway)
