"""What the vLLM container is, whatever declares it: a systemd unit of ours or
a NixOS oci-containers module. Pure."""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from serving.container_unit import RUNTIME_PATHS, log_options
from serving.replicas import Served
from serving.vllm_serve import serve_args

CONTAINER_CACHE = "/root/.cache/huggingface"
# the image's own settings (DOMAIN.md): V2 model runner, weights from the cache only, no Xet
ENVIRONMENT = {"VLLM_USE_V2_MODEL_RUNNER": "1", "HF_HUB_OFFLINE": "1", "HF_HUB_DISABLE_XET": "1"}


@dataclass
class ContainerSpec:
    runtime: str
    name: str
    image: str
    cmd: list  # the model first, then vllm serve's flags (the image's entrypoint is `vllm serve`)
    volumes: list
    gpu: list  # how the runtime hands the GPU over
    network: list = field(default_factory=lambda: ["--network=host", "--ipc=host"])
    environment: dict = field(default_factory=lambda: dict(ENVIRONMENT))
    secret_names: list = field(default_factory=list)  # from the 0600 environment file, by name only


    @property
    def gpu_options(self) -> list[str]:
        """The GPU options as ``--flag=value`` (oci-containers' extraOptions)."""
        return [f"{flag}={value}" for flag, value in zip(self.gpu[::2], self.gpu[1::2])]


def handed_gpus(unit_text: str) -> tuple:
    """The GPUs (uuids) a unit we wrote hands its container, as `gpu_handover` wrote them (none
    when it hands every GPU): for day 2, which has the unit but not the placement."""
    found = re.findall(r"nvidia\.com/gpu=(GPU-[0-9A-Za-z-]+)", unit_text)
    for devices in re.findall(r"device=([0-9A-Za-z,-]+)", unit_text):
        found += [d for d in devices.split(",") if d.startswith("GPU-")]
    return tuple(dict.fromkeys(found))


def gpu_handover(runtime: str, gpus: list[str] | None) -> list[str]:
    """How the runtime hands these GPUs (uuids; None: every GPU) to the container."""
    if runtime == "podman":  # CDI names each GPU by index and by uuid
        return [arg for uuid in gpus or ["all"] for arg in ("--device", f"nvidia.com/gpu={uuid}")]
    if not gpus:
        return ["--gpus", "all"]
    # docker reads --gpus as CSV: several devices are quoted so that their commas stay one field
    return ["--gpus", f"device={gpus[0]}" if len(gpus) == 1 else f'"device={",".join(gpus)}"']


def container_spec(v: dict, image: str, served: Served, has_token: bool) -> ContainerSpec:
    """One replica's container: its own name and loopback port, handed only its GPUs."""
    runtime = served.replica.runtime
    return ContainerSpec(
        runtime=runtime, name=served.replica.container, image=image,
        cmd=serve_args(served.variables(v), served.model, served.utilization, served.tensor_parallel_size,
                       served.replica.port, served.family),
        volumes=[f"{v.get('model_cache', '/srv/models/hf-cache')}:{CONTAINER_CACHE}",
                 f"{v.get('compile_cache', '/var/cache/vllm')}:/root/.cache/vllm"],
        gpu=gpu_handover(runtime, list(served.gpus) or None),
        secret_names=["VLLM_API_KEY"] + (["HF_TOKEN"] if has_token else []))



def run_command(spec: ContainerSpec) -> list[str]:
    """``RUNTIME run --rm --name NAME ... IMAGE MODEL FLAGS`` as the unit's ExecStart."""
    run = [RUNTIME_PATHS[spec.runtime], "run", "--rm", "--name", spec.name, *log_options(spec.runtime),
           *spec.gpu, *spec.network]
    for volume in spec.volumes:
        run += ["-v", volume]
    for name in spec.secret_names:
        # names only: the values come from EnvironmentFile, so they never reach a command line
        run += ["-e", name]
    for key, value in spec.environment.items():
        run += ["-e", f"{key}={value}"]
    return run + [spec.image, *spec.cmd]
