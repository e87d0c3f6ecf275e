"""The fleet as one host's roles need to see it: which hosts serve (their front
doors), which are gateways and which watch the others (the group `monitoring`:
Prometheus and Alertmanager). Offered to every host of a run as
``ctx.services["fleet"]``, from the whole inventory (a gateway lists every serving
host, whichever hosts the run touches)."""
from __future__ import annotations

from dataclasses import dataclass, field

from converge.runner import RunService

GATEWAY_GROUP = "gateway"
MONITORING_GROUP = "monitoring"
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


def fleet_of(hostvars_by_name: dict[str, dict]) -> Fleet:
    serving, gateways, monitors = [], [], []
    for name, v in hostvars_by_name.items():
        door = FrontDoor(name, v.get("ansible_host", name), int(v.get("api_port", 8000)),
                         v.get("tls_ca_file") or "" if v.get("tls_cert_file") else "",
                         {k: v[k] for k in MODEL_VARIABLES if k in v})
        if is_monitoring(v):
            monitors.append(door)
        if is_gateway(v):
            gateways.append(door)
        elif is_serving(v):
            serving.append(door)
    return Fleet(tuple(serving), tuple(gateways), tuple(monitors))


class FleetService(RunService):
    name = "fleet"

    def __init__(self, hostvars_by_name: dict[str, dict]):
        self.fleet = fleet_of(hostvars_by_name)

    def for_host(self, transport, hostvars):
        return self.fleet

    def close(self):
        return None


def is_serving(hostvars: dict) -> bool:
    """Every host but the gateways and the monitoring hosts serves the model."""
    return not is_gateway(hostvars) and not is_monitoring(hostvars)


def is_exporting(hostvars: dict) -> bool:
    """The hosts whose metrics the monitoring hosts scrape through their front door (or
    gateway): every serving host and every gateway."""
    return is_serving(hostvars) or is_gateway(hostvars)
