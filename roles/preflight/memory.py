"""Predict vLLM's start-up memory check before anything starts.

vLLM 0.33.0 (``vllm/v1/worker/utils.py::request_memory``) asks for
``ceil(total * util)`` bytes and refuses to start when the free memory is lower. Both
figures are CUDA's (``torch.cuda.mem_get_info``), read by the worker once it has made its
CUDA context and its cuBLAS handles (``gpu_worker.py``, before ``MemorySnapshot``):
- CUDA's total leaves out what the driver reserves: it is nvidia-smi's used + free, not its
  memory.total (81079 of 81559 MiB on an H100);
- the free memory the worker sees is nvidia-smi's, less what the worker took for itself:
  WORKER_MIB, measured on an H100 by bench/vllm_memory (719 MiB idle, 716 with another
  process holding 20 GiB; CUDA 13.0, PyTorch 2.11). The same process's context alone is
  the 518 MiB the two-H200 capture shows on the GPU it did not allocate on.
On unified-memory GPUs (GB10) nvidia-smi has no memory figures and vLLM takes the
host's MemTotal and MemAvailable; we do the same.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

MIB = 1024 * 1024
GIB = 1024 ** 3
MAX_UTILIZATION = 0.95
# what vLLM's worker holds on its GPU before it reads the free memory (bench/vllm_memory)
WORKER_MIB = 720


@dataclass
class GpuMemory:
    total_mib: float  # the card's (nvidia-smi memory.total; MemTotal on unified memory)
    free_mib: float  # free now, before vLLM starts (nvidia-smi memory.free; MemAvailable)
    unified: bool  # figures come from /proc/meminfo, not the GPU
    cuda_total_mib: float | None = None  # what CUDA calls total (used + free); None: total_mib

    @property
    def source(self) -> str:
        return "host MemTotal/MemAvailable (unified memory)" if self.unified else "nvidia-smi"

    @property
    def vllm_total_mib(self) -> float:
        """The total vLLM multiplies by gpu_memory_utilization."""
        return self.cuda_total_mib if self.cuda_total_mib is not None else self.total_mib

    @property
    def vllm_free_mib(self) -> float:
        """The free memory vLLM's worker will see once it has started (not measured on unified memory)."""
        return self.free_mib if self.unified else self.free_mib - WORKER_MIB


def gpu_memory(gpu: dict, meminfo: dict) -> GpuMemory:
    if gpu.get("memory_total_mib") is None or gpu.get("memory_free_mib") is None:
        return GpuMemory(meminfo["MemTotal"], meminfo["MemAvailable"], True)
    used = gpu.get("memory_used_mib")
    return GpuMemory(gpu["memory_total_mib"], gpu["memory_free_mib"], False,
                     used + gpu["memory_free_mib"] if used is not None else None)


def requested_bytes(mem: GpuMemory, util: float) -> int:
    return math.ceil(mem.vllm_total_mib * MIB * util)


def passes_vllm_check(mem: GpuMemory, util: float) -> bool:
    return requested_bytes(mem, util) <= mem.vllm_free_mib * MIB


def vllm_refusal(mem: GpuMemory, util: float, device: str = "cuda:0") -> str:
    """vLLM's own words for a refused start, with the figures it will print."""
    return (f"Free memory on device {device} ({mem.vllm_free_mib * MIB / GIB:.2f}/"
            f"{mem.vllm_total_mib * MIB / GIB:.2f} GiB) on startup is less than desired GPU memory utilization "
            f"({util}, {requested_bytes(mem, util) / GIB:.2f} GiB). Decrease GPU memory utilization or reduce "
            f"GPU memory used by other processes.")


def check_words(mem: GpuMemory, util: float) -> str:
    """Why a value passes, in numbers."""
    worker = "" if mem.unified else f", once vLLM's worker holds its {WORKER_MIB} MiB"
    return (f"ceil({util} x {mem.vllm_total_mib:.0f} MiB) <= {mem.vllm_free_mib:.0f} MiB free"
            f"{worker}")


def largest_safe_utilization(mem: GpuMemory, margin_mib: float) -> float:
    """The largest util (two decimals, at most 0.95) that passes with ``margin_mib`` to spare."""
    usable = mem.vllm_free_mib - margin_mib
    if usable <= 0:
        return 0.0
    util = math.floor(usable / mem.vllm_total_mib * 100) / 100
    util = min(util, MAX_UTILIZATION)
    spare = GpuMemory(mem.total_mib, mem.free_mib - margin_mib, mem.unified, mem.cuda_total_mib)
    while util > 0 and not passes_vllm_check(spare, util):
        util = round(util - 0.01, 2)
    return max(util, 0.0)


def budget_mib(mem: GpuMemory, util: float) -> float:
    """What vLLM will have: utilization times CUDA's total."""
    return mem.vllm_total_mib * util
