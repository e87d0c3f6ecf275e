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

from serving.replicas import port as replica_port

from serving.declared import declared, family_of, title
from .memory import (WORKER_MIB, GpuMemory, budget_mib, check_words, gpu_memory, largest_safe_utilization,
                     passes_vllm_check, vllm_refusal)
from .variants import Refused, candidates

TENSOR_PARALLEL_SIZES = (2, 4, 8)


@dataclass
class Placed:
    """A replica as the placement gives it: where it runs and why."""
    index: int
    gpus: list  # the GPUs' facts (nvidia-smi rows), in the order vLLM numbers them
    tensor_parallel_size: int
    model: str
    quantization: str | None
    utilization: float
    port: int
    reason: str  # why this variant (and tensor parallel size)
    utilization_reason: str = ""
    memory: GpuMemory | None = None  # its first GPU's, as vLLM's check reads it
    family: str = "diffusiongemma"  # the model family (models: in the inventory)
    settings: dict = field(default_factory=dict)  # serving settings its models: entry sets for it alone

    def as_dict(self) -> dict:
        return {"index": self.index, "family": self.family, "gpus": [g["uuid"] for g in self.gpus], "gpu_indices": [g["index"] for g in self.gpus],
                "tensor_parallel_size": self.tensor_parallel_size, "model": self.model,
                "quantization": self.quantization, "gpu_memory_utilization": self.utilization, "port": self.port,
                "reason": self.reason, "utilization_reason": self.utilization_reason}


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
    # a row without gpu_uuid (an older driver's query) may be on any GPU: it is named on each
    mine = [a for a in apps if a.get("gpu_uuid") in (gpu["uuid"], None)]
    return ", ".join(f"{a['name']} (pid {a['pid']}, {a['used_memory_mib']} MiB)" for a in mine)


def _usable(gpu: dict, mem: GpuMemory, hostvars: dict, running: dict, apps: list[dict]) -> tuple[float | None, str]:
    """The utilization vLLM would start with on this GPU, or None and why not."""
    if (gpu.get("mig_mode") or "").lower() == "enabled":
        return None, (f"MIG mode is on: vLLM is given whole GPUs here; turn MIG off (nvidia-smi -i {gpu['index']} "
                      f"-mig 0, then reset the GPU) or leave GPU {gpu['index']} out of gpus:")
    explicit = hostvars.get("gpu_memory_utilization", "auto")
    margin = hostvars.get("gpu_memory_margin_mib", 1024)
    if gpu["uuid"] in running:
        # our own replica holds this memory now: vLLM's check is for a fresh start, and `auto`
        # keeps the value it resolved to when the replica started (else every run would differ)
        if explicit != "auto":
            return explicit, "set by the inventory; our replica runs there, so its own memory is not free now"
        return running[gpu["uuid"]], "auto: the value chosen when the running replica started, kept while it runs"
    held = _held_by(gpu, apps)
    if explicit != "auto":
        if passes_vllm_check(mem, explicit):
            return explicit, f"set by the inventory; {check_words(mem, explicit)}"
        safe = largest_safe_utilization(mem, margin)
        # each replica is handed its GPUs alone: vLLM in it calls this one cuda:0
        return None, (f"vLLM would refuse to start on GPU {gpu['index']}: {vllm_refusal(mem, explicit)} "
                      f"Free memory now: {mem.free_mib:.0f} of {mem.total_mib:.0f} MiB ({mem.source})"
                      f"{'; held by ' + held if held else ''}. The largest safe value now is {safe:.2f}: set "
                      f"gpu_memory_utilization: {safe:.2f} (or auto), or free the GPU.")
    util = largest_safe_utilization(mem, margin)
    if util <= 0:
        return None, (f"{mem.free_mib:.0f} of {mem.total_mib:.0f} MiB free, less than the {margin} MiB margin"
                      f"{'; held by ' + held if held else ''}")
    worker = "" if mem.unified else f", less the {WORKER_MIB} MiB of vLLM's worker"
    return util, (f"auto: the largest value with {margin} MiB to spare of {mem.vllm_free_mib:.0f} MiB free "
                  f"({mem.free_mib:.0f} by {mem.source}{worker}), at most 0.95")


def _variants(cc: str, hostvars: dict) -> list[tuple[str, dict]]:
    """The catalog's variants of the family placed for this compute capability, in preference order."""
    return candidates(cc, hostvars, hostvars.get("family", "diffusiongemma"))


def _fits(spec: dict, size: int, budgets: list[float]) -> bool:
    """Whether one rank's share (weights / size + runtime) fits every GPU's budget."""
    need = spec["weights_mib"] / size + spec["overhead_mib"]
    return all(b >= need for b in budgets)


def _first_fit(variants: list, mem: GpuMemory, util: float, cc: str, hostvars: dict):
    """The first variant, in preference order, that one GPU serves alone: (model, spec,
    reason), or (None, None, what each variant lacks)."""
    budget = budget_mib(mem, util)
    shortfalls = []
    for model, spec in variants:
        if not spec:
            return model, spec, "set by the inventory (model); not in the catalog, so its memory need is unchecked"
        need = spec["weights_mib"] + spec["overhead_mib"]
        if mem.total_mib < spec["min_gpu_memory_mib"]:
            shortfalls.append(f"{model} needs a GPU of {spec['min_gpu_memory_mib']} MiB, this one has "
                              f"{mem.total_mib:.0f}")
        elif budget < need:
            shortfalls.append(f"{model} needs {need} MiB ({spec['weights_mib']} weights + {spec['overhead_mib']} "
                              f"runtime) but {util} x {mem.vllm_total_mib:.0f} MiB gives {budget:.0f}")
        else:
            reason = (f"compute capability {cc} prefers {spec['quantization']}" if not hostvars.get("model")
                      else "set by the inventory (model)")
            reason += f"; needs {need} MiB, budget {budget:.0f} MiB"
            return model, spec, reason + (f" (skipped: {'; '.join(shortfalls)})" if shortfalls else "")
    return None, None, "; ".join(shortfalls)


def place(nvidia: dict, meminfo: dict, hostvars: dict, running: dict | None = None) -> Placement:
    """``nvidia``: the NvidiaSmi fact; ``running``: GPU uuid -> the utilization our replica
    that runs there started with."""
    running = running or {}
    apps = nvidia.get("compute_apps", [])
    candidates, named = selected(nvidia["gpus"], hostvars.get("gpus", "all"))
    wanted = hostvars.get("gpus")
    count = wanted if isinstance(wanted, int) and not isinstance(wanted, bool) else None
    placement = Placement()
    usable = []
    for gpu in candidates:
        if not gpu.get("compute_capability"):
            why, util, mem = "nvidia-smi reports no compute capability: update the driver", None, None
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
    for (name, _, cc), members in groups.items():
        variants = _variants(cc, hostvars)
        alone = []
        for gpu, mem, util, why in members:
            model, spec, reason = _first_fit(variants, mem, util, cc, hostvars)
            if model is None:
                alone.append((gpu, mem, util, why, reason))
                continue
            placement.replicas.append(Placed(0, [gpu], 1, model, spec.get("quantization"), util, 0,
                                              reason, why, mem))
        _tensor_parallel(alone, variants, name, placement, hostvars.get("family_title", "DiffusionGemma"))
    placement.replicas.sort(key=lambda r: r.gpus[0]["index"])
    for index, replica in enumerate(placement.replicas):
        replica.index, replica.port = index, replica_port(hostvars, index)
    placement.skipped.sort(key=lambda s: s["index"])
    if named and placement.skipped:
        first = placement.skipped[0]
        raise Refused(f"GPU {first['index']} ({first['uuid']}): {first['reason']}")
    return placement


def keep_indices(placement: Placement, previous: dict[str, int], hostvars: dict) -> Placement:
    """Number the replicas so that one on the GPUs a deployed replica holds keeps that
    replica's index (and so its unit, container and port): a GPU that becomes busy stops
    its own replica alone, and the others are not renamed. ``previous``: GPU uuid -> index."""
    taken: set[int] = set()
    for replica in placement.replicas:
        index = previous.get(replica.gpus[0]["uuid"])
        replica.index = index if index is not None and index not in taken else None
        if replica.index is not None:
            taken.add(replica.index)
    free = (i for i in range(len(placement.replicas) + len(previous) + 1) if i not in taken)
    for replica in placement.replicas:
        if replica.index is None:
            replica.index = next(free)
        replica.port = replica_port(hostvars, replica.index)
    placement.replicas.sort(key=lambda r: r.index)
    return placement


def _tensor_parallel(left: list, variants: list, name: str, placement: Placement, family: str):
    """GPUs no variant fits alone: served N at a time (the most free first), or left out."""
    left = sorted(left, key=lambda e: -e[1].free_mib)
    for size in TENSOR_PARALLEL_SIZES:
        while len(left) >= size:
            group = left[:size]
            util = min(e[2] for e in group)  # vLLM applies one fraction to every rank
            budgets = [budget_mib(e[1], util) for e in group]
            chosen = next(((model, spec) for model, spec in variants if spec and
                           _fits(spec, size, budgets)), None)
            if chosen is None:
                break
            model, spec = chosen
            need = spec["weights_mib"] / size + spec["overhead_mib"]
            first = min(group, key=lambda e: e[2])
            placement.replicas.append(Placed(0, [e[0] for e in group], size, model, spec["quantization"], util, 0,
                                              f"{name}: no variant fits one GPU; {spec['quantization']} fits "
                                              f"{size} with tensor parallel ({need:.0f} MiB per GPU)",
                                              first[3], first[1]))
            left = left[size:]
    for gpu, mem, util, _, shortfalls in left:
        held = f" ({mem.total_mib - mem.free_mib:.0f} MiB in use)" if mem.free_mib < mem.total_mib * 0.9 else ""
        together = "; nor with the other GPUs left out, in tensor parallel" if len(left) > 1 else ""
        placement.skipped.append({"uuid": gpu["uuid"], "index": gpu["index"],
                                  "reason": f"no {family} variant fits{held}: {shortfalls}{together}"})


def place_declared(nvidia: dict, meminfo: dict, hostvars: dict, running: dict | None = None) -> Placement:
    """Every family the host declares (``models:``, declared.py), each placed as ``place``
    does on the GPUs its entry takes: named GPUs first, then counts from the GPUs left, then
    the rest. A GPU no entry takes is left out with that reason; an entry that places nothing
    is refused, with what each of its GPUs lacks."""
    entries = declared(hostvars)
    taken: dict[str, str] = {}  # GPU uuid -> the family serving there
    reasons: dict[str, dict] = {}  # GPU uuid -> why left out (the first reason that is not a count's)
    replicas = []
    for entry in entries:
        sub = {**hostvars, "gpus": entry.gpus, "family": entry.family, "family_title": title(entry.family),
               "quantization": entry.quantization, **entry.settings}
        sub.pop("model", None)
        if entry.model:
            sub["model"] = entry.model
        if entry.named:
            gpus = nvidia["gpus"]
            for item in entry.gpus:
                uuid = next((g["uuid"] for g in gpus if item in (g["index"], g["uuid"])), None)
                if uuid in taken:
                    raise Refused(f"{entry.where}.gpus: GPU {item} is taken by {taken[uuid]} too: give each GPU "
                                  f"one family")
        else:
            gpus = [g for g in nvidia["gpus"] if g["uuid"] not in taken]
            if not gpus:
                raise Refused(f"{entry.where}: no GPU is left for {title(entry.family)} (the other entries take "
                              f"every GPU): give it a list of GPUs, or fewer to the others")
            if entry.counted and entry.gpus > len(gpus):
                raise Refused(f"{entry.where}.gpus: {entry.gpus}, but {len(gpus)} GPU(s) are left for "
                              f"{title(entry.family)}")
        placed = place({**nvidia, "gpus": gpus}, meminfo, sub, running)
        if not placed.replicas and len(entries) > 1:
            raise Refused(f"{entry.where}: {title(entry.family)} can serve on none of its GPUs: "
                          + "; ".join(f"GPU {s['index']} ({s['uuid']}): {s['reason']}" for s in placed.skipped))
        for replica in placed.replicas:
            replica.family, replica.settings = family_of(replica.model, entry.family), dict(entry.settings)
            for gpu in replica.gpus:
                taken[gpu["uuid"]] = entry.family
                reasons.pop(gpu["uuid"], None)
            replicas.append(replica)
        for skip in placed.skipped:
            if skip["uuid"] not in taken and (skip["uuid"] not in reasons or
                                              reasons[skip["uuid"]]["reason"].startswith("gpus: ")):
                reasons[skip["uuid"]] = skip
    placement = Placement(sorted(replicas, key=lambda r: r.gpus[0]["index"]))
    for gpu in nvidia["gpus"]:
        if gpu["uuid"] not in taken and gpu["uuid"] not in reasons and len(entries) > 1:
            reasons[gpu["uuid"]] = {"uuid": gpu["uuid"], "index": gpu["index"],
                                    "reason": "no entry of models: takes it"}
    placement.skipped = sorted(reasons.values(), key=lambda s: s["index"])
    for index, replica in enumerate(placement.replicas):
        replica.index, replica.port = index, replica_port(hostvars, index)
    return placement
