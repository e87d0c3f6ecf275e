"""A host's hardware as GPU Feature Discovery labels a Kubernetes node, and the node selector
terms that find the nodes a choice fits. Pure.

GFD's labels (NVIDIA/k8s-device-plugin, docs/gpu-feature-discovery): ``nvidia.com/gpu.product``
(NVML's name, spaces as ``-``), ``nvidia.com/gpu.memory`` (MiB), ``nvidia.com/gpu.count``,
``nvidia.com/cuda.runtime-version.major``/``.minor`` (the CUDA version the driver supports,
what the image tag is chosen by), and Kubernetes' own ``kubernetes.io/arch``."""
from __future__ import annotations

import re

from converge.facts.nvidia import cuda_tuple

from .serving import ServingHost

ARCH = {"x86_64": "amd64", "aarch64": "arm64"}  # uname -m -> kubernetes.io/arch
PRODUCT = "nvidia.com/gpu.product"
MEMORY = "nvidia.com/gpu.memory"
CUDA_MAJOR = "nvidia.com/cuda.runtime-version.major"
CUDA_MINOR = "nvidia.com/cuda.runtime-version.minor"


class HardwareError(ValueError):
    """A host whose hardware cannot be named as GFD names it."""


def product_label(name: str) -> str:
    """GFD's product label for an NVML name: ``NVIDIA H100 80GB HBM3`` -> ``NVIDIA-H100-80GB-HBM3``."""
    return re.sub(r"\s+", "-", name.strip())


def labels(host: ServingHost) -> dict[str, str]:
    """The GFD labels of the node this host would be."""
    if host.arch not in ARCH:
        raise HardwareError(f"{host.name}: arch {host.arch!r} has no Kubernetes name (kubernetes.io/arch); "
                            f"the image catalog builds for {', '.join(ARCH)}")
    names = {g.get("name") or "" for g in host.gpus}
    if not host.gpus or names == {""} or not all(re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9 ._()-]*", n) for n in names):
        raise HardwareError(f"{host.name}: gpus[0].name {sorted(names)[0] if names else None!r} is no GPU that GPU "
                            f"Feature Discovery names (nvidia.com/gpu.product): check nvidia-smi on the host "
                            f"(invoke facts --hosts {host.name})")
    if len(names) > 1:
        raise HardwareError(f"{host.name}: GPUs of more than one product ({', '.join(sorted(names))}); a node's "
                            f"nvidia.com/gpu.product names one: give the render hosts of one product each")
    cuda = cuda_tuple(host.cuda_version)
    if cuda is None:
        raise HardwareError(f"{host.name}: cuda_version {host.cuda_version!r}: the driver's CUDA version is unknown")
    out = {"kubernetes.io/arch": ARCH[host.arch], PRODUCT: product_label(host.product),
           "nvidia.com/gpu.count": str(len(host.gpus)), CUDA_MAJOR: str(cuda[0]), CUDA_MINOR: str(cuda[1])}
    memory = host.gpus[0].get("memory_total_mib")
    if memory:  # a unified-memory GPU (GB10) has none
        out[MEMORY] = str(int(memory))
    return out


def _expr(key: str, operator: str, *values) -> dict:
    return {"key": key, "operator": operator, "values": [str(v) for v in values]}


def cuda_terms(lowest: tuple[int, int], below: tuple[int, int] | None) -> list[list[dict]]:
    """Node selector terms (OR of ANDs) for a driver CUDA version in [lowest, below): the range
    of one image tag of the catalog (its min_cuda, up to the next better tag's)."""
    major, minor = lowest
    terms = []
    if below is None and minor == 0:
        return [[_expr(CUDA_MAJOR, "Gt", major - 1)]]
    if below is None or below[0] > major:
        terms.append([_expr(CUDA_MAJOR, "In", major), _expr(CUDA_MINOR, "Gt", minor - 1)])
        if below is None:
            terms.append([_expr(CUDA_MAJOR, "Gt", major)])
        else:
            if below[0] > major + 1:
                terms.append([_expr(CUDA_MAJOR, "Gt", major), _expr(CUDA_MAJOR, "Lt", below[0])])
            if below[1] > 0:
                terms.append([_expr(CUDA_MAJOR, "In", below[0]), _expr(CUDA_MINOR, "Lt", below[1])])
    else:
        terms.append([_expr(CUDA_MAJOR, "In", major), _expr(CUDA_MINOR, "Gt", minor - 1),
                      _expr(CUDA_MINOR, "Lt", below[1])])
    return terms


def node_selector_terms(host_labels: dict[str, str], cuda_range: tuple, hostnames: list[str] | None = None) -> list:
    """The terms the chart's ``nodeSelectorTerms`` takes: this hardware (arch, product, memory)
    with a driver CUDA in ``cuda_range``; ``hostnames`` when hosts of one hardware are set up apart
    (their inventory variables differ), so that GFD's labels alone cannot tell them."""
    fixed = [_expr("kubernetes.io/arch", "In", host_labels["kubernetes.io/arch"]),
             _expr(PRODUCT, "In", host_labels[PRODUCT])]
    if MEMORY in host_labels:
        fixed.append(_expr(MEMORY, "In", host_labels[MEMORY]))
    if hostnames:
        fixed.append(_expr("kubernetes.io/hostname", "In", *hostnames))
    if cuda_range is None:  # the inventory's own image: no CUDA range of the catalog's
        return [{"matchExpressions": fixed}]
    return [{"matchExpressions": fixed + term} for term in cuda_terms(*cuda_range)]
