"""What one role hands the roles after it, typed: each a `converge.changes.Output` that
a role decides (a `Decision` step) or a step produces, and the later roles (and the
day-2 commands and summaries that run after them) read as ``ctx.results[OUTPUT]``.
Declared here, beside no role, so that no role reaches into another's ``role.py``."""
from __future__ import annotations

from dataclasses import dataclass

from converge.changes import Output

from serving.replicas import Replica, Served


@dataclass
class Choice:
    """The image, and the placement of replicas on the GPUs; the host's model and memory
    are its first replica's."""
    image: str
    image_reason: str
    placement: object  # placement.Placement: every replica, and the GPUs left out

    @property
    def replicas(self) -> list:
        return self.placement.replicas

    @property
    def model(self) -> str:
        return self.replicas[0].model

    @property
    def quantization(self) -> str | None:
        return self.replicas[0].quantization

    @property
    def model_reason(self) -> str:
        return self.replicas[0].reason

    @property
    def utilization(self) -> float:
        return self.replicas[0].utilization

    @property
    def utilization_reason(self) -> str:
        return self.replicas[0].utilization_reason

    @property
    def memory(self):  # preflight's memory.GpuMemory
        return self.replicas[0].memory

    @property
    def notes(self) -> list[str]:
        return [f"GPU {s['index']} ({s['uuid']}) left out: {s['reason']}" for s in self.placement.skipped]

    def as_dict(self) -> dict:
        return {"image": self.image, "image_reason": self.image_reason, "model": self.model,
                "quantization": self.quantization, "model_reason": self.model_reason,
                "gpu_memory_utilization": self.utilization, "utilization_reason": self.utilization_reason,
                "memory_total_mib": round(self.memory.total_mib), "memory_free_mib": round(self.memory.free_mib),
                "memory_source": self.memory.source, **self.placement.as_dict()}


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


def gated(unit: str) -> Output:
    """What a roll that gated ``unit`` produces: the start role does not wait for it again."""
    return Output(f"gated {unit}", str)
