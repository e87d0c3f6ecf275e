"""What a serving host keeps of the gateway it ran once it is no longer in the group `gateway`:
its HAProxy would hold ``api_port``, where the host's front door goes back, and its folder and
environment file hold the gateway's key and the upstreams' keys, which the host no longer needs.
The front door's role removes them, before it moves (roles/frontdoor): the gateway's unit, its
usage service, their files, and the host's share of the shared address (keepalived stopped and
disabled, our configuration removed; a keepalived configuration that is not ours is left alone).
The usage service's counts (its state folder) and the journal's records stay."""
from __future__ import annotations

from converge.facts.host import UnitState

from serving import accounting, leftovers
from serving.fleet import (SHARED_ADDRESS_CHECK, SHARED_ADDRESS_CONF, SHARED_ADDRESS_MANAGED, SHARED_ADDRESS_UNIT,
                           api_port, is_gateway)
from serving.haproxy.instance import GATEWAY, GATEWAY_ENV_FILE

FACT = "gateway_left"


def facts(v: dict) -> dict:
    """On a host outside the group `gateway`: whether a gateway's unit is still there."""
    return {} if is_gateway(v) else {FACT: UnitState(GATEWAY.unit_name(v))}


def script(v: dict) -> str:
    """files/leftovers_removed.sh with this host's units and files."""
    return leftovers.script(
        units=(GATEWAY.unit_name(v), accounting.UNIT),
        files=(GATEWAY.unit_path(v), accounting.UNIT_PATH, GATEWAY_ENV_FILE, accounting.PROGRAM),
        folders=(GATEWAY.dir, GATEWAY.socket_dir),
        shared_unit=SHARED_ADDRESS_UNIT, shared_conf=SHARED_ADDRESS_CONF, shared_check=SHARED_ADDRESS_CHECK, ours=SHARED_ADDRESS_MANAGED)


def removal(ctx):
    """The gateway left on a host that is no longer in the group `gateway`, removed; nothing when
    there is none."""
    if is_gateway(ctx.vars) or not leftovers.still_there(ctx.facts, (FACT,)):
        return
    unit = GATEWAY.unit_name(ctx.vars)
    yield leftovers.removal(
        "gateway removed", script(ctx.vars),
        describe=f"{ctx.name} is no longer in the group `gateway`: stop and remove {unit}, {accounting.UNIT}, the "
                 f"gateway's files and keys, and its share of the shared address (its HAProxy holds port "
                 f"{api_port(ctx.vars)}, where the front door goes back)",
        done=f"{unit} and {accounting.UNIT} stopped and removed, with the gateway's files and keys, and "
             f"{SHARED_ADDRESS_UNIT} stopped")
