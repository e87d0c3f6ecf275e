"""Place vLLM replicas on a host's GPUs: pure functions over the GPU facts.

vLLM's own guidance for a model that fits one GPU is one server per GPU (a crash
stays on its GPU; changes and hand-over go GPU by GPU). Tensor parallelism is for
a variant that fits no single GPU but fits N of them (FP8 on two 24 GB cards).
So, for each group of alike GPUs (same name and memory: mixed GPUs are placed
group by group), every usable GPU gets a replica of the first variant, in the
catalog's preference order, that fits it alone; the GPUs no variant fits alone
are then tried together, 2, 4 or 8 at a time, each with the first variant whose
share fits every one of them.

A GPU is left out, with the reason, when MIG is on or when vLLM's start-up memory
check would fail on it (its free memory counts every process's memory there,
CUDA contexts too); a GPU named in ``gpus:`` that cannot serve is refused with
vLLM's words instead. A GPU that runs our own replica keeps the utilization it
started with (its memory is that replica's, not free).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .memory import GpuMemory, budget_mib, gpu_memory, largest_safe_utilization, passes_vllm_check, vllm_refusal
from .select import Refused

TENSOR_PARALLEL_SIZES = (2, 4, 8)


@dataclass
class Replica:
    index: int
    gpus: list  # the GPUs' facts (nvidia-smi rows), in the order vLLM numbers them
    tensor_parallel_size: int
    model: str
    quantization: str | None
    utilization: float
    port: int
    reason: str

    def as_dict(self) -> dict:
        return {"gpus": [g["uuid"] for g in self.gpus], "gpu_indices": [g["index"] for g in self.gpus],
                "tensor_parallel_size": self.tensor_parallel_size, "model": self.model,
                "quantization": self.quantization, "gpu_memory_utilization": self.utilization, "port": self.port,
                "reason": self.reason}


@dataclass
class Placement:
    replicas: list = field(default_factory=list)
    skipped: list = field(default_factory=list)  # {"uuid", "index", "reason"}

    def as_dict(self) -> dict:
        return {"replicas": [r.as_dict() for r in self.replicas],
                "skipped_gpus": [{"uuid": s["uuid"], "reason": s["reason"]} for s in self.skipped]}


def selected(gpus: list[dict], wanted) -> tuple[list[dict], bool]:
    """The GPUs ``gpus:`` names (all, a count, or indices and UUIDs), and whether
    they were named one by one (then one that cannot serve is refused, not skipped)."""
    if wanted in (None, "all"):
        return list(gpus), False
    if isinstance(wanted, int) and not isinstance(wanted, bool):
        if not 1 <= wanted <= len(gpus):
            raise Refused(f"gpus: {wanted}, but this host has {len(gpus)} GPU(s)")
        return list(gpus), False  # the count is taken from the usable ones (place)
    by_index = {g["index"]: g for g in gpus}
    by_uuid = {g["uuid"]: g for g in gpus}
    out = []
    for item in wanted:
        gpu = by_uuid.get(item) if isinstance(item, str) else by_index.get(item)
        if gpu is None:
            have = ", ".join(f"{g['index']} ({g['uuid']})" for g in gpus)
            raise Refused(f"gpus: {item!r} is not a GPU of this host; it has {have}")
        if gpu not in out:
            out.append(gpu)
    return out, True


def _held_by(gpu: dict, apps: list[dict]) -> str:
    mine = [a for a in apps if a.get("gpu_uuid") == gpu["uuid"]]
    return ", ".join(f"{a['name']} (pid {a['pid']}, {a['used_memory_mib']} MiB)" for a in mine)


def _usable(gpu: dict, mem: GpuMemory, hostvars: dict, running: dict, apps: list[dict]) -> tuple[float | None, str]:
    """The utilization vLLM would start with on this GPU, or None and why not."""
    if (gpu.get("mig_mode") or "").lower() == "enabled":
        return None, (f"MIG mode is on: vLLM is given whole GPUs here; turn MIG off (nvidia-smi -i {gpu['index']} "
                      f"-mig 0, then reset the GPU) or leave GPU {gpu['index']} out of gpus:")
    if gpu["uuid"] in running:
        return running[gpu["uuid"]], "our replica runs there: the value it started with is kept"
    explicit = hostvars.get("gpu_memory_utilization", "auto")
    margin = hostvars.get("gpu_memory_margin_mib", 1024)
    held = _held_by(gpu, apps)
    if explicit != "auto":
        if passes_vllm_check(mem, explicit):
            return explicit, f"set by the inventory; ceil({explicit} x {mem.total_mib:.0f} MiB) <= " \
                             f"{mem.free_mib:.0f} MiB free"
        # each replica is handed its GPUs alone: vLLM in it calls this one cuda:0
        return None, (f"vLLM would refuse to start on GPU {gpu['index']}: {vllm_refusal(mem, explicit)}"
                      f"{' Held by ' + held + '.' if held else ''}")
    util = largest_safe_utilization(mem, margin)
    if util <= 0:
        return None, (f"{mem.free_mib:.0f} of {mem.total_mib:.0f} MiB free, less than the {margin} MiB margin"
                      f"{'; held by ' + held if held else ''}")
    return util, f"auto: the largest value with {margin} MiB to spare of {mem.free_mib:.0f} MiB free"


def _variants(cc: str, hostvars: dict) -> list[tuple[str, dict]]:
    """The catalog's variants for this compute capability, in preference order (select.py's)."""
    from .select import _candidates
    return _candidates(cc, hostvars)


def _fits(spec: dict, size: int, budgets: list[float], totals: list[float]) -> tuple[bool, float]:
    """Whether one rank's share (weights / size + runtime) fits every GPU's budget."""
    need = spec["weights_mib"] / size + spec["overhead_mib"]
    enough_card = size > 1 or min(totals) >= spec["min_gpu_memory_mib"]
    return enough_card and all(b >= need for b in budgets), need


def place(nvidia: dict, meminfo: dict, hostvars: dict, running: dict | None = None) -> Placement:
    """``nvidia``: the NvidiaSmi fact; ``running``: GPU uuid -> utilization of our
    replicas that run there now."""
    running = running or {}
    apps = nvidia.get("compute_apps", [])
    candidates, named = selected(nvidia["gpus"], hostvars.get("gpus", "all"))
    wanted = hostvars.get("gpus")
    count = wanted if isinstance(wanted, int) and not isinstance(wanted, bool) else None
    placement = Placement()
    usable = []
    for gpu in candidates:
        if not gpu.get("compute_capability"):
            why = "nvidia-smi reports no compute capability: update the driver"
            util = None
        else:
            mem = gpu_memory(gpu, meminfo)
            util, why = _usable(gpu, mem, hostvars, running, apps)
        if util is None:
            if named:
                raise Refused(f"GPU {gpu['index']} ({gpu['uuid']}): {why}")
            placement.skipped.append({"uuid": gpu["uuid"], "index": gpu["index"], "reason": why})
            continue
        usable.append((gpu, mem, util, why))
    if count is not None:
        for gpu, *_ in usable[count:]:
            placement.skipped.append({"uuid": gpu["uuid"], "index": gpu["index"],
                                      "reason": f"gpus: {count} (the first {count} usable GPUs serve)"})
        usable = usable[:count]
    groups: dict[tuple, list] = {}
    for entry in usable:
        gpu = entry[0]
        groups.setdefault((gpu["name"], gpu.get("memory_total_mib"), gpu["compute_capability"]), []).append(entry)
    port = int(hostvars.get("replica_base_port", 8100))
    for (name, _, cc), members in groups.items():
        variants = _variants(cc, hostvars)
        alone = []
        for gpu, mem, util, why in members:
            for model, spec in variants:
                ok, need = _fits(spec, 1, [budget_mib(mem, util)], [mem.total_mib]) if spec else (True, 0)
                if ok:
                    placement.replicas.append(Replica(0, [gpu], 1, model, spec.get("quantization"), util, 0,
                                                      f"{name}: {spec.get('quantization') or model} fits one GPU "
                                                      f"({why})"))
                    break
            else:
                alone.append((gpu, mem, util, why))
        _tensor_parallel(alone, variants, name, placement)
    placement.replicas.sort(key=lambda r: r.gpus[0]["index"])
    for index, replica in enumerate(placement.replicas):
        replica.index, replica.port = index, port + index
    placement.skipped.sort(key=lambda s: s["index"])
    if named and placement.skipped:
        first = placement.skipped[0]
        raise Refused(f"GPU {first['index']} ({first['uuid']}): {first['reason']}")
    return placement


def _tensor_parallel(left: list, variants: list, name: str, placement: Placement):
    """GPUs no variant fits alone: served N at a time (the most free first), or left out."""
    left = sorted(left, key=lambda e: -e[1].free_mib)
    for size in TENSOR_PARALLEL_SIZES:
        while len(left) >= size:
            group = left[:size]
            util = min(e[2] for e in group)  # vLLM applies one fraction to every rank
            budgets = [budget_mib(e[1], util) for e in group]
            chosen = next(((model, spec) for model, spec in variants if spec and
                           _fits(spec, size, budgets, [e[1].total_mib for e in group])[0]), None)
            if chosen is None:
                break
            model, spec = chosen
            need = spec["weights_mib"] / size + spec["overhead_mib"]
            placement.replicas.append(Replica(0, [e[0] for e in group], size, model, spec["quantization"], util, 0,
                                              f"{name}: no variant fits one GPU; {spec['quantization']} fits "
                                              f"{size} with tensor parallel ({need:.0f} MiB per GPU)"))
            left = left[size:]
    needs = [spec["weights_mib"] + spec["overhead_mib"] for _, spec in variants if spec]
    for gpu, mem, util, _ in left:
        held = f" ({mem.total_mib - mem.free_mib:.0f} MiB in use)" if mem.free_mib < mem.total_mib * 0.9 else ""
        placement.skipped.append({"uuid": gpu["uuid"], "index": gpu["index"],
                                  "reason": f"no DiffusionGemma variant fits: {budget_mib(mem, util):.0f} MiB usable of "
                                            f"{mem.total_mib:.0f}{held} at gpu_memory_utilization {util}; the "
                                            f"smallest variant needs {min(needs, default=0)} MiB on one GPU, and the "
                                            f"GPUs left out cannot serve it together"})
