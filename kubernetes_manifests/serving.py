"""What the render knows of each serving host: its variables, what it read of its hardware,
and the choice the SSH deploy makes for it (roles/preflight/select.choose), from the same
facts. Pure."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ServingHost:
    name: str
    vars: dict
    arch: str  # uname -m
    cuda_version: str | None  # the driver's CUDA (nvidia-smi)
    gpus: tuple  # nvidia-smi rows (converge/facts/nvidia.parse_gpu_query)
    choice: object  # roles.preflight.select.Choice

    @property
    def product(self) -> str:
        return self.gpus[0]["name"] if self.gpus else ""
