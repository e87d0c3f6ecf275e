"""Choose the image tag, the model variant and the memory fraction for a host.

Pure functions over facts and variables; each choice comes with the reason, in
words, so that ``invoke facts`` can say why.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from converge.errors import StepFailed
from converge.facts.nvidia import cuda_tuple

from . import catalog
from .memory import (GpuMemory, budget_mib, gpu_memory, largest_safe_utilization, passes_vllm_check,
                     vllm_refusal)


class Refused(StepFailed):
    """No image or model can serve on this host; the message says what to do."""


@dataclass
class Choice:
    image: str
    image_reason: str
    model: str
    quantization: str | None
    model_reason: str
    utilization: float
    utilization_reason: str
    memory: GpuMemory
    gpu: dict
    notes: list = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"image": self.image, "image_reason": self.image_reason, "model": self.model,
                "quantization": self.quantization, "model_reason": self.model_reason,
                "gpu_memory_utilization": self.utilization, "utilization_reason": self.utilization_reason,
                "memory_total_mib": round(self.memory.total_mib), "memory_free_mib": round(self.memory.free_mib),
                "memory_source": self.memory.source}


def _version(text: str) -> tuple:
    return tuple(int(p) for p in str(text).split("."))


def choose_image(arch: str, cuda: str | None, hostvars: dict) -> tuple[str, str]:
    if hostvars.get("image"):
        return hostvars["image"], "set by the inventory (image)"
    cat = catalog.images()
    channel = hostvars.get("image_channel", "gemma")
    rows = cat["channels"].get(channel)
    if not rows:
        raise Refused(f"image_channel {channel!r} is not in the image catalog (roles/preflight/images.yml); it has "
                      f"{', '.join(cat['channels'])}")
    have = cuda_tuple(cuda)
    if have is None:
        raise Refused(f"the driver's CUDA version is unknown (nvidia-smi printed neither 'CUDA Version' nor 'CUDA UMD Version'): "
                      f"{cat['remedy']}")
    arches = {r["arch"] for r in rows}
    if arch not in arches:
        raise Refused(f"no vLLM image is built for {arch}; the catalog has {', '.join(sorted(arches))}")
    for row in rows:
        if row["arch"] == arch and have >= _version(row["min_cuda"]):
            ref = f"{cat['repository']}:{row['tag']}"
            registry = hostvars.get("registry")
            if registry:
                ref = f"{registry.rstrip('/')}/{ref}"
            return ref, (f"{arch} with driver CUDA {cuda} >= {row['min_cuda']} "
                         f"({channel} channel){', through mirror ' + registry if registry else ''}")
    lowest = min(_version(r["min_cuda"]) for r in rows if r["arch"] == arch)
    raise Refused(f"the driver supports CUDA {cuda}, older than any {channel} image "
                  f"(CUDA {'.'.join(map(str, lowest))} at least): {cat['remedy']}")


def _candidates(cc: str, hostvars: dict) -> list[tuple[str, dict]]:
    cat = catalog.models()["variants"]
    if hostvars.get("model"):
        model = hostvars["model"]
        return [(model, cat.get(model, {}))]
    have = _version(cc)
    wanted = hostvars.get("quantization", "auto")
    for row in catalog.models()["preference"]:
        if have >= _version(row["min_compute_capability"]):
            order = row["order"] if wanted == "auto" else [wanted]
            out = []
            for quant in order:
                for model, spec in cat.items():
                    if spec["quantization"] == quant:
                        if have < _version(spec["min_compute_capability"]):
                            raise Refused(f"{quant} needs compute capability {spec['min_compute_capability']} "
                                          f"or newer; this GPU has {cc}. Set quantization: auto")
                        out.append((model, spec))
            return out
    raise Refused(f"compute capability {cc} is older than any DiffusionGemma variant supports (8.0)")


def choose(facts: dict, hostvars: dict) -> Choice:
    """facts: ``arch``, ``nvidia`` (NvidiaSmi), ``meminfo``."""
    arch = facts["arch"]
    nvidia = facts["nvidia"]
    image, image_reason = choose_image(arch, nvidia.get("cuda_version"), hostvars)
    gpu = nvidia["gpus"][0]
    cc = gpu["compute_capability"]
    if not cc:
        raise Refused("nvidia-smi reports no compute capability for GPU 0: update the driver")
    mem = gpu_memory(gpu, facts["meminfo"])
    explicit = hostvars.get("gpu_memory_utilization", "auto")
    margin = hostvars.get("gpu_memory_margin_mib", 1024)
    notes = []
    if len(nvidia["gpus"]) > 1:
        notes.append(f"{len(nvidia['gpus'])} GPUs; vLLM runs on GPU 0 (tensor parallel 1)")

    if explicit != "auto" and not hostvars.get("_skip_memory_check") and not passes_vllm_check(mem, explicit):
        safe = largest_safe_utilization(mem, margin)
        apps = ", ".join(f"{a['name']} (pid {a['pid']}, {a['used_memory_mib']} MiB)"
                         for a in nvidia.get("compute_apps", []))
        raise Refused(f"vLLM would refuse to start: {vllm_refusal(mem, explicit)} "
                      f"Free memory now: {mem.free_mib:.0f} of {mem.total_mib:.0f} MiB ({mem.source})"
                      f"{'; held by ' + apps if apps else ''}. The largest safe value now is {safe:.2f}: set "
                      f"gpu_memory_utilization: {safe:.2f} (or auto), or free the GPU.")
    util = explicit if explicit != "auto" else largest_safe_utilization(mem, margin)
    util_reason = ("auto: the value chosen when the running service started, kept while it runs"
                   if hostvars.get("_auto_kept") else
                   "set by the inventory; the service runs, so its own memory is not free now"
                   if hostvars.get("_skip_memory_check") and explicit != "auto" else
                   f"set by the inventory; ceil({util} x {mem.total_mib:.0f} MiB) <= {mem.free_mib:.0f} MiB free"
                   if explicit != "auto" else
                   f"auto: the largest value with {margin} MiB to spare of {mem.free_mib:.0f} MiB free "
                   f"({mem.source}), at most 0.95")
    budget = budget_mib(mem, util)
    shortfalls = []
    for model, spec in _candidates(cc, hostvars):
        if not spec:
            return Choice(image, image_reason, model, None, "set by the inventory (model); not in the catalog, "
                          "so its memory need is unchecked", util, util_reason, mem, gpu, notes)
        need = spec["weights_mib"] + spec["overhead_mib"]
        if mem.total_mib < spec["min_gpu_memory_mib"]:
            shortfalls.append(f"{model} needs a GPU of {spec['min_gpu_memory_mib']} MiB, this one has "
                              f"{mem.total_mib:.0f}")
            continue
        if budget < need:
            shortfalls.append(f"{model} needs {need} MiB ({spec['weights_mib']} weights + {spec['overhead_mib']} "
                              f"runtime) but {util} x {mem.total_mib:.0f} MiB gives {budget:.0f}")
            continue
        reason = (f"compute capability {cc} prefers {spec['quantization']}"
                  if not hostvars.get("model") else "set by the inventory (model)")
        reason += f"; needs {need} MiB, budget {budget:.0f} MiB"
        if shortfalls:
            reason += f" (skipped: {'; '.join(shortfalls)})"
        return Choice(image, image_reason, model, spec["quantization"], reason, util, util_reason, mem, gpu, notes)
    raise Refused(f"not enough GPU memory for any DiffusionGemma variant: {'; '.join(shortfalls)}. "
                  f"Free memory on the GPU (stop what holds it) or use a larger GPU.")
