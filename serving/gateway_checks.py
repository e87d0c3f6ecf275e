"""What refuses a host as a gateway, read before anything changes on it: by the gateway role,
and on a host that serves as well by preflight, first of all, since on such a host the front
door moves aside from ``api_port`` before the gateway's role runs: a gateway refused only then
would leave the host answering nothing at the address its clients use."""
from __future__ import annotations

from converge.changes import Check

from serving.haproxy.pools import aliases, answers, fleet_families, serving


def refusals(v: dict, facts, fleet) -> list[Check]:
    """The failed checks that keep this host from being a gateway of ``fleet`` (none: it may be)."""
    if ((facts.get("os") if facts else None) or {}).get("ID") == "nixos":
        # the service role's module declares the front door alone, and keepalived comes from apt or dnf
        return [Check("gateway host", ok=False,
                      message="a NixOS gateway is not supported: its container and keepalived would have to be "
                              "declared in the host's configuration; choose a host of another OS for the group "
                              "`gateway` (it may serve as well)")]
    if fleet is None or not fleet.serving:
        return [Check("serving hosts", ok=False, message="the inventory has no serving host for the gateway to "
                                                         "front: add hosts outside the group `gateway`, or list a "
                                                         "gateway in a group of serving hosts too")]
    problems = fallback_problems(fleet, v.get("model_fallback") or {})
    return [Check("model_fallback", ok=False, message="; ".join(problems))] if problems else []


def fallback_problems(fleet, policy: dict) -> list[str]:
    """What keeps ``model_fallback`` from working with this fleet, each naming the key."""
    out = []
    families = fleet_families(fleet)
    for family, rule in policy.items():
        where = f"model_fallback.{family}"
        if family not in families:
            out.append(f"{where}: no host of the fleet serves {family} (it serves {', '.join(families)})")
            continue
        target = rule.get("to")
        if target is None:
            continue
        if target == family or target not in families:
            others = [f for f in families if f != family]
            remedy = (f"name another family of the fleet ({', '.join(others)}) or a url" if others else
                      "the fleet serves no other family: name a url, or take the rule out")
            out.append(f"{where}.to: {target} is {'the family itself' if target == family else 'served by no host'}; "
                       f"{remedy}")
            continue
        alias = aliases(fleet, family)[0]
        deaf = [door.host for door in serving(fleet, target) if alias not in answers(door, target)]
        if deaf:
            out.append(f"{where}: the {target} replicas of {', '.join(deaf)} do not answer to {alias!r} (vLLM would "
                       f"refuse its requests): set model_fallback where those hosts read it too (group_vars/all)")
    return out
