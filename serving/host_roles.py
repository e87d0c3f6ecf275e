"""What each host of an inventory is for, as `invoke inventory.check` shows it: the models it
serves, the gateway and its turn at the shared address, the monitoring. Read from its groups
and variables as the roles read them (serving/fleet.py, serving/declared.py), so that what it
says is what a deploy does."""
from __future__ import annotations

from dataclasses import dataclass

from .declared import Refused, declared
from .fleet import GATEWAY_GROUP, MONITORING_GROUP, is_gateway, is_monitoring, is_serving

# groups that say nothing of what a host is for
_NEUTRAL_GROUPS = {"all", "ungrouped", GATEWAY_GROUP, MONITORING_GROUP}
_ORDINALS = ("first", "second", "third")


@dataclass(frozen=True)
class HostRoles:
    host: str
    roles: tuple[str, ...]  # what it does, each a phrase
    warnings: tuple[str, ...] = ()  # what its inventory says that a deploy will not do
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


def host_roles(hostvars_by_name: dict[str, dict], direct_groups: dict[str, list[str]]) -> list[HostRoles]:
    """Each host's roles, in inventory order. ``direct_groups``: the groups that list each host
    itself (not through a child group): a gateway or monitoring host listed in another group too
    was likely meant to serve, and does not."""
    gateways = [name for name, v in hostvars_by_name.items() if is_gateway(v)]
    out = []
    for name, v in hostvars_by_name.items():
        roles, warnings, problem = [], [], None
        if is_serving(v):
            try:
                roles.append(_serves(v))
            except Refused as exc:
                problem = str(exc)
        if is_gateway(v):
            roles.append(_gateway(name, v, gateways))
        if is_monitoring(v):
            roles.append("monitoring (Prometheus, Alertmanager)")
        other = [g for g in direct_groups.get(name, ()) if g not in _NEUTRAL_GROUPS]
        if other and not is_serving(v):
            special = " and ".join(g for g in (GATEWAY_GROUP, MONITORING_GROUP) if g in v.get("group_names", ()))
            warnings.append(f"serves no model although the group{'s' if len(other) > 1 else ''} "
                            f"{', '.join(other)} list{'' if len(other) > 1 else 's'} it: a host of the group "
                            f"{special} runs no replica; take it out of {special} for it to serve")
        out.append(HostRoles(name, tuple(roles), tuple(warnings), problem))
    return out
