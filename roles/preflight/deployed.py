"""What the running service was started with, read from the unit or module that
declares it: its GPUs and its gpu_memory_utilization. Pure."""
from __future__ import annotations

import re

# podman's CDI device (the unit's `--device nvidia.com/gpu=X`, the module's "--device=nvidia.com/gpu=X")
_CDI = re.compile(r"nvidia\.com/gpu=([A-Za-z0-9-]+)")
# docker's --gpus all / device=X[,Y] (quoted when it names several)
_DOCKER = re.compile(r"""--gpus[ =][\\"']*(all|device=[A-Za-z0-9,-]+)""")
# the unit's ExecStart (--gpu-memory-utilization 0.7) or the module's cmd ("--gpu-memory-utilization" "0.7")
_UTILIZATION = re.compile(r'--gpu-memory-utilization"?\s+"?([0-9.]+)')


def deployed_gpus(declared: str, gpus: list[dict]) -> dict:
    """GPU uuid -> the utilization the declared service was started with. A unit of a
    release that handed over every GPU ran on GPU 0 (vLLM's cuda:0)."""
    utilization = _UTILIZATION.search(declared)
    if not utilization or not gpus:
        return {}
    names = _CDI.findall(declared)
    docker = _DOCKER.search(declared)
    if docker:
        names = ["all"] if docker.group(1) == "all" else docker.group(1)[len("device="):].split(",")
    by_index = {str(g["index"]): g["uuid"] for g in gpus}
    uuids = []
    for name in names:
        uuid = gpus[0]["uuid"] if name == "all" else by_index.get(name, name)
        if uuid not in uuids:
            uuids.append(uuid)
    return {uuid: float(utilization.group(1)) for uuid in uuids}


# a container of the NixOS module: `virtualisation.oci-containers.containers."NAME" = {`
_MODULE_CONTAINER = re.compile(r'oci-containers\.containers\.("?)([A-Za-z0-9_.-]+)\1 = \{')


def module_containers(module: str) -> dict[str, str]:
    """Container name -> its part of a NixOS module's text."""
    marks = list(_MODULE_CONTAINER.finditer(module))
    return {m.group(2): module[m.start():marks[i + 1].start() if i + 1 < len(marks) else len(module)]
            for i, m in enumerate(marks)}


def deployed_replicas(declared: dict[int, str], gpus: list[dict]) -> dict[int, dict]:
    """Replica index -> {GPU uuid: utilization} for each replica's declaration (its unit,
    or its container in the NixOS module) that hands it GPUs."""
    found = {index: deployed_gpus(text, gpus) for index, text in declared.items()}
    return {index: held for index, held in found.items() if held}
