"""The fleet as one host's roles need to see it: which hosts serve (their front
doors), which are gateways and which watch the others (the group `monitoring`:
Prometheus and Alertmanager). Offered to every host of a run as
``ctx.services["fleet"]``, from the whole inventory (a gateway lists every serving
host, whichever hosts the run touches).

A host of the group `gateway` or `monitoring` serves too when another group lists it
itself (rtx01 in `rtx` and in `gateway`): its front door then moves aside for the
gateway (`frontdoor_port`), which takes the address clients use (`api_port`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from converge.runner import RunService

# the unit that holds a gateway's share of the shared address (roles/shared_address; a gateway's
# restart hands the address on by stopping it: serving/haproxy/files/handoff.sh)
SHARED_ADDRESS_UNIT = "keepalived.service"
SHARED_ADDRESS_CONF = "/etc/keepalived/keepalived.conf"  # where Debian's and Fedora's keepalived.service read it
SHARED_ADDRESS_CHECK = "/etc/keepalived/dgemma-gateway-answers"
# the first line of the configuration and the check script the shared_address role writes: a
# keepalived configuration without it is someone else's, left alone
SHARED_ADDRESS_MANAGED = "# Managed by dgemma-fleet (roles/shared_address)"
GATEWAY_GROUP = "gateway"
MONITORING_GROUP = "monitoring"
# groups that say what a host does besides serving, and those that say nothing of it
ROLE_GROUPS = (GATEWAY_GROUP, MONITORING_GROUP)
NEUTRAL_GROUPS = {"all", "ungrouped", *ROLE_GROUPS}
MODEL_VARIABLES = ("models", "gpus", "model", "quantization", "served_model_name", "model_fallback")


@dataclass(frozen=True)
class FrontDoor:
    host: str
    address: str  # where the gateway reaches it (its ansible_host)
    port: int
    ca_file: str = ""  # the CA of a certificate of its own (tls_ca_file), which the gateway must trust too
    # what the host declares of its models (models:, served_model_name, model_fallback): the
    # roles read the families it serves and their names from these (roles/frontdoor/pools.py)
    models: dict = field(default_factory=dict, compare=False, hash=False)


@dataclass(frozen=True)
class Fleet:
    serving: tuple  # FrontDoor, in inventory order
    gateways: tuple  # FrontDoor
    monitors: tuple = ()  # FrontDoor of each monitoring host (a gateway may be one too)

    @property
    def has_gateway(self) -> bool:
        return bool(self.gateways)


def is_gateway(hostvars: dict) -> bool:
    return GATEWAY_GROUP in (hostvars.get("group_names") or ())


def is_monitoring(hostvars: dict) -> bool:
    """A host of the group `monitoring`: it runs Prometheus and Alertmanager for the fleet."""
    return MONITORING_GROUP in (hostvars.get("group_names") or ())


def shared_address(hostvars: dict) -> str | None:
    """The address the gateways share (``gateway_address``), for a gateway; None elsewhere."""
    return hostvars.get("gateway_address") if is_gateway(hostvars) else None


def api_port(hostvars: dict) -> int:
    """Where clients reach the host: its gateway's port on a gateway, else its front door's."""
    return int(hostvars.get("api_port", 8000))


def frontdoor_port(hostvars: dict) -> int:
    """The front door's port: ``frontdoor_port`` when set; else ``api_port``, or the port after
    it on a host that is a gateway too (the gateway holds ``api_port`` there)."""
    if hostvars.get("frontdoor_port"):
        return int(hostvars["frontdoor_port"])
    return api_port(hostvars) + (1 if is_gateway(hostvars) else 0)


def fleet_of(hostvars_by_name: dict[str, dict]) -> Fleet:
    serving, gateways, monitors = [], [], []
    for name, v in hostvars_by_name.items():
        address = v.get("ansible_host", name)
        ca_file = v.get("tls_ca_file") or "" if v.get("tls_cert_file") else ""
        models = {k: v[k] for k in MODEL_VARIABLES if k in v}
        if is_monitoring(v):
            monitors.append(FrontDoor(name, address, api_port(v), ca_file, models))
        if is_gateway(v):
            gateways.append(FrontDoor(name, address, api_port(v), ca_file, models))
        if is_serving(v):
            serving.append(FrontDoor(name, address, frontdoor_port(v), ca_file, models))
    return Fleet(tuple(serving), tuple(gateways), tuple(monitors))


class FleetService(RunService):
    name = "fleet"

    def __init__(self, hostvars_by_name: dict[str, dict]):
        self.fleet = fleet_of(hostvars_by_name)

    def for_host(self, transport, hostvars):
        return self.fleet

    def close(self):
        return None


def serving_groups(hostvars: dict) -> list[str]:
    """The groups that list the host itself and say nothing of a gateway or monitoring
    (``direct_group_names``, converge/play.py; ``group_names`` where a caller gives no other)."""
    direct = hostvars.get("direct_group_names")
    listed = direct if direct is not None else hostvars.get("group_names") or ()
    return [g for g in listed if g not in NEUTRAL_GROUPS]


def is_serving(hostvars: dict) -> bool:
    """A host serves the model unless it is a gateway or a monitoring host that no other group
    lists itself: rtx01 in `rtx` and `gateway` serves and is a gateway; gateway01 in `gateway`
    alone (or through a parent group of `gateway`) serves nothing."""
    if not is_gateway(hostvars) and not is_monitoring(hostvars):
        return True
    return bool(serving_groups(hostvars))


def is_exporting(hostvars: dict) -> bool:
    """The hosts whose metrics the monitoring hosts scrape through their front door (or
    gateway): every serving host and every gateway."""
    return is_serving(hostvars) or is_gateway(hostvars)
