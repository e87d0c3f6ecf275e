"""Predict vLLM's start-up memory check before anything starts.

vLLM 0.33.0 (``vllm/v1/worker/utils.py::request_memory``) asks for
``ceil(total * util)`` bytes and refuses to start when the free memory is lower.
On unified-memory GPUs (GB10) nvidia-smi has no memory figures and vLLM takes
the host's MemAvailable as free memory; we do the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1024 * 1024
GIB = 1024 ** 3
MAX_UTILIZATION = 0.95


@dataclass
class GpuMemory:
    total_mib: float
    free_mib: float
    unified: bool  # figures come from /proc/meminfo, not the GPU

    @property
    def source(self) -> str:
        return "host MemTotal/MemAvailable (unified memory)" if self.unified else "nvidia-smi"


def gpu_memory(gpu: dict, meminfo: dict) -> GpuMemory:
    if gpu.get("memory_total_mib") is None or gpu.get("memory_free_mib") is None:
        return GpuMemory(meminfo["MemTotal"], meminfo["MemAvailable"], True)
    return GpuMemory(gpu["memory_total_mib"], gpu["memory_free_mib"], False)


def requested_bytes(total_mib: float, util: float) -> int:
    return math.ceil(total_mib * MIB * util)


def passes_vllm_check(mem: GpuMemory, util: float) -> bool:
    return requested_bytes(mem.total_mib, util) <= mem.free_mib * MIB


def vllm_refusal(mem: GpuMemory, util: float, device: str = "cuda:0") -> str:
    """vLLM's own words for a refused start."""
    return (f"Free memory on device {device} ({mem.free_mib * MIB / GIB:.2f}/{mem.total_mib * MIB / GIB:.2f} GiB) "
            f"on startup is less than desired GPU memory utilization ({util}, "
            f"{requested_bytes(mem.total_mib, util) / GIB:.2f} GiB). Decrease GPU memory utilization or reduce "
            f"GPU memory used by other processes.")


def largest_safe_utilization(mem: GpuMemory, margin_mib: float) -> float:
    """The largest util (two decimals, at most 0.95) that passes with ``margin_mib`` to spare."""
    usable = mem.free_mib - margin_mib
    if usable <= 0:
        return 0.0
    util = math.floor(usable / mem.total_mib * 100) / 100
    util = min(util, MAX_UTILIZATION)
    while util > 0 and not passes_vllm_check(GpuMemory(mem.total_mib, mem.free_mib - margin_mib, mem.unified), util):
        util = round(util - 0.01, 2)
    return max(util, 0.0)


def budget_mib(mem: GpuMemory, util: float) -> float:
    return mem.total_mib * util
