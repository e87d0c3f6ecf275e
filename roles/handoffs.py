"""What one role hands the roles after it, typed: each a `converge.changes.Output` that
a role decides (a `Decision` step) or a step produces, and the later roles (and the
day-2 commands and summaries that run after them) read as ``ctx.results[OUTPUT]``.
Declared here, beside no role, so that no role reaches into another's ``role.py``."""
from __future__ import annotations

from dataclasses import dataclass

from converge.changes import Output

from roles.preflight.select import Choice
from roles.replicas import Replica, Served


@dataclass(frozen=True)
class UnitPlan:
    """A replica as the service role declares it: what it runs, the names it answers to, and
    the text that declares it (its unit, or on NixOS the module that declares every replica)."""
    served: Served
    served_name: str
    served_names: tuple
    unit_path: str
    unit_text: str

    @property
    def replica(self) -> Replica:
        return self.served.replica


@dataclass(frozen=True)
class Units:
    """Every replica the service role declares on a host, and by what (``unit``: our unit
    files; ``nixos``: our module)."""
    replicas: tuple  # UnitPlan, by index
    declared_by: str
    image: str

    def by_index(self) -> dict[int, UnitPlan]:
        return {plan.replica.index: plan for plan in self.replicas}


# preflight: the image, the model variants and where each replica runs
CHOICE = Output("the choice of image, model and placement", Choice)
# service: every replica as declared (start, frontdoor, exporters and the rolls read it)
UNITS = Output("the replicas as declared", Units)
# frontdoor, gateway: when the certificates they serve expire (the exporters' textfile)
CERTIFICATES = Output("the certificates' expiry", dict)
# frontdoor, gateway: the generation of the configuration they answer with (verify)
FRONTDOOR_GENERATION = Output("the front door's generation", str)
GATEWAY_GENERATION = Output("the gateway's generation", str)
# exporters: where the host's GPU metrics come from ("dcgm", "nvidia-smi"; none off a GPU host)
GPU_METRICS = Output("the source of the GPU metrics", str)
# monitoring: its files planned (verify checks its units)
MONITORING = Output("the monitoring stack planned", bool)
# shared_address: the sha256 of keepalived's configuration (verify)
KEEPALIVED = Output("keepalived's configuration", str)
