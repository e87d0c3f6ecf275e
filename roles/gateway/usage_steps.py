"""The gateway's accounting on its host: the files HAProxy reads the keys' names and limits
from and its Lua (a change is a reload of the gateway), and the usage service (its program
and unit; a change is a restart, before the gateway's HAProxy, which sends it records)."""
from __future__ import annotations


from converge.changes import Check, Command, File
from converge.errors import StepFailed
from converge.facts.host import Commands, FileState, UnitState

from serving.haproxy.instance import GATEWAY, runtime_socket
from serving.host_programs import RESULT_LIBRARY, Program, Protocol, ended
from serving.systemd import SYSTEMD_FILE, systemd_parameters

from serving import key_limits as limits

from serving import accounting as acc

USAGE_RUNNING = Protocol("the usage service running", result={
    "state": "ready (it has bound its socket again), failed (its unit; its last log lines before) or timeout",
    "seconds": "since the action", "unit_state": "systemctl is-active"}, exits={"failed": 3, "timeout": 4})
USAGE_RUNNING_PROGRAM = Program((SYSTEMD_FILE, RESULT_LIBRARY, acc.FILES / "usage_running.sh"), USAGE_RUNNING)
READY_TIMEOUT_S = 30


def map_facts(v) -> dict:
    """The files `map_files` writes."""
    d = GATEWAY.dir
    return {"gateway_keys_map": FileState(f"{d}/{acc.KEYS_MAP}", secret=True),
            "gateway_limits_map": FileState(f"{d}/{acc.LIMITS_MAP}", secret=True),
            "gateway_lua": FileState(f"{d}/{acc.LUA}")}


def facts(v) -> dict:
    return {**map_facts(v),
            "usage_program": FileState(acc.PROGRAM),
            "usage_unit_file": FileState(acc.UNIT_PATH),
            "usage_unit": UnitState(acc.UNIT),
            "usage_commands": Commands("python3")}


def limits_in_force(store_limits: dict[str, dict], hashes: dict[str, str], defaults: dict | None) -> dict:
    """Each accepted key's limits (the inventory's own key, api_key_file, never limited)."""
    return {name: limits.UNLIMITED if name == limits.OPERATOR else limits.effective(defaults, store_limits.get(name))
            for name in hashes}


def map_files(ctx, hashes: dict[str, str], in_force: dict) -> tuple[File, ...]:
    """What HAProxy reads (extra files of the gateway: a change is a reload). The key names and
    their limits say who uses the fleet: root's alone on the host, as the key hashes are."""
    d, f = GATEWAY.dir, ctx.facts
    return (File("gateway key names (sha256)", path=f"{d}/{acc.KEYS_MAP}", content=limits.keys_map(hashes),
                 mode="0600", secret=True, current=f.get("gateway_keys_map")),
            File("gateway key limits", path=f"{d}/{acc.LIMITS_MAP}", content=limits.limits_map(in_force),
                 mode="0600", secret=True, current=f.get("gateway_limits_map")),
            File("gateway accounting (Lua)", path=f"{d}/{acc.LUA}", content=acc.lua(), mode="0644",
                 current=f.get("gateway_lua")))


def service_steps(ctx):
    """The usage service: python3 on the host, its program and unit, running with its socket bound."""
    f, v = ctx.facts, ctx.vars
    if not (f.get("usage_commands") or {}).get("python3"):
        yield Check("python3 for the usage service", ok=False,
                    message="the gateway's usage service (request records, usage per key, the day's tokens) runs "
                            "on the host's python3, which is not there: install it (apt-get install python3-minimal, "
                            "dnf install python3), then deploy again")
        return
    program = File("usage service", path=acc.PROGRAM, content=acc.program(), mode="0755",
                   current=f.get("usage_program"))
    unit = File("usage service unit", path=acc.UNIT_PATH, content=acc.render_unit(v, runtime_socket(GATEWAY)),
                mode="0644", current=f.get("usage_unit_file"))
    yield program
    yield unit
    state = f.get("usage_unit") or {}
    if state.get("ActiveState") != "active":
        action, why = "start", f"was {state.get('ActiveState', 'absent')}"
    elif program.needed() or unit.needed():
        action, why = "restart", "its program or unit changed"
    else:
        action, why = "none", ""
    enabled = state.get("UnitFileState") == "enabled"
    script = USAGE_RUNNING_PROGRAM.script({**systemd_parameters(acc.UNIT, action, daemon_reload=action != "none",
                                                                enable=True),
                                           "SOCKET": acc.SOCKET, "TIMEOUT_S": READY_TIMEOUT_S})
    yield Command("usage service running", script=script, when=action != "none" or not enabled,
                  describe=f"systemctl {action if action != 'none' else 'enable'} {acc.UNIT} "
                           f"({why or 'not enabled at boot'})",
                  timeout=READY_TIMEOUT_S + 30, interpret=_interpret(why or "enabled at boot", waited=action != "none"))


def _interpret(why: str, waited: bool):
    def interpret(result):
        if not waited and result.rc == 0:
            return f"{acc.UNIT} takes the gateway's records on {acc.SOCKET} ({why})"
        said, journal = ended(USAGE_RUNNING, result, acc.UNIT)
        if result.rc == 0 and said["state"] == "ready":
            return f"{acc.UNIT} takes the gateway's records on {acc.SOCKET} ({why})"
        why_not = (f"its unit is {said['unit_state']} after {said['seconds']} s" if said["state"] == "failed" else
                   f"after {said['seconds']} s, {said['unit_state']}")
        raise StepFailed(f"{acc.UNIT} did not bind {acc.SOCKET} within {READY_TIMEOUT_S} s ({why_not}). "
                         f"Last log lines:\n{journal}\nSee: journalctl -u {acc.UNIT}")
    return interpret
