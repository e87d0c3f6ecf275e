"""What each host of an inventory is for, as `invoke inventory.check` shows it: the models it
serves, the gateway and its turn at the shared address, the monitoring. Read from its groups
and variables as the roles read them (serving/fleet.py, serving/declared.py), so that what it
says is what a deploy does."""
from __future__ import annotations

from dataclasses import dataclass

from .declared import Refused, declared
from .fleet import frontdoor_port, is_gateway, is_monitoring, is_serving

_ORDINALS = ("first", "second", "third")


@dataclass(frozen=True)
class HostRoles:
    host: str
    roles: tuple[str, ...]  # what it does, each a phrase
    problem: str | None = None  # what stops a deploy of it


def _gpus(gpus) -> str:
    if gpus == "all":
        return " on the GPUs left"
    if isinstance(gpus, list):
        return f" on GPU {', '.join(str(g) for g in gpus)}"
    return f" on {gpus} GPU{'s' if gpus != 1 else ''}"


def _serves(hostvars: dict) -> str:
    entries = declared(hostvars)
    if len(entries) == 1 and entries[0].gpus == "all":
        return f"serves {entries[0].family}"
    return "serves " + ", ".join(e.family + _gpus(e.gpus) for e in entries)


def _gateway(host: str, hostvars: dict, gateways: list[str]) -> str:
    shared = hostvars.get("gateway_address")
    if not shared:
        return "gateway (no shared address: clients use its own)"
    position = gateways.index(host)
    turn = _ORDINALS[position] if position < len(_ORDINALS) else f"number {position + 1}"
    if position == 0:
        return f"gateway, {turn} to hold {shared}"
    # keepalived's priority follows the inventory's order of the gateways (roles/shared_address)
    return f"gateway, {turn} in line for {shared} (after {', '.join(gateways[:position])})"


def host_roles(hostvars_by_name: dict[str, dict]) -> list[HostRoles]:
    """Each host's roles, in inventory order. A gateway that serves too says where its front door
    moved (the gateway holds ``api_port`` there)."""
    gateways = [name for name, v in hostvars_by_name.items() if is_gateway(v)]
    out = []
    for name, v in hostvars_by_name.items():
        roles, problem = [], None
        if is_serving(v):
            try:
                roles.append(_serves(v) + (f" (its front door on port {frontdoor_port(v)})"
                                           if is_gateway(v) else ""))
            except Refused as exc:
                problem = str(exc)
        if is_gateway(v):
            roles.append(_gateway(name, v, gateways))
        if is_monitoring(v):
            roles.append("monitoring (Prometheus, Alertmanager)")
        out.append(HostRoles(name, tuple(roles), problem))
    return out
