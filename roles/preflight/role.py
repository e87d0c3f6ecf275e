"""preflight: read the host, choose image, model and memory, and stop the host
with the remedy in words when something it needs is missing."""
from __future__ import annotations

from converge.changes import Check, Decision, Role
from converge.facts import FactError
from converge.facts.containers import Runtimes
from converge.facts.host import Arch, Commands, DiskFree, FileState, MemInfo, OsRelease, Systemd
from converge.facts.nvidia import NvidiaSmi

from serving.fleet import is_gateway, is_serving
from serving.gateway_checks import refusals
from serving.haproxy.reach import reach_step
from serving.handoffs import CHOICE
from serving.hf_cache import status as weights_complete
from serving.nixos_module import module_path
from serving.vllm_serve import diffusion_wanted, generation_wanted
from serving.replicas import from_container, units_of
from serving.serving_host import UNITS_FACT, units_fact

from serving import catalog
from serving.declared import DEFAULT_FAMILY
from .deployed import deployed_replicas, module_containers
from .placement import keep_indices
from .select import Refused, choose

CONTAINER_STORAGE = {"podman": "/var/lib/containers", "docker": "/var/lib/docker"}


def facts(hostvars):
    return {
        "arch": Arch(),
        "os": OsRelease(),
        "meminfo": MemInfo(),
        "systemd": Systemd(),
        "nvidia": NvidiaSmi(hostvars.get("nvidia_smi_timeout", 15)),
        "runtimes": Runtimes(),
        "commands": Commands("flock", "base64", "sha256sum", "sha1sum", "curl", "timeout", "awk", "tee", "xargs"),
        "disk_cache": DiskFree(hostvars.get("model_cache", "/srv/models/hf-cache")),
        "disk_images": DiskFree(CONTAINER_STORAGE[hostvars.get("container_runtime", "podman")]),
        # whether our own replicas run (their memory is then not free), and what they started with
        **units_fact(hostvars),
        "nixos_module": FileState(module_path(hostvars)),
    }


def runtime_problem(runtime: str, runtimes: dict) -> str | None:
    """What keeps ``runtime`` from giving a container the GPU, or None."""
    if runtime == "podman":
        if not runtimes.get("podman"):
            return "podman is not installed: apt-get install podman (4.x or newer)"
        if not runtimes.get("cdi_specs"):
            return ("podman has no CDI spec for nvidia.com/gpu: install nvidia-container-toolkit and run "
                    "nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml")
        return None
    if not runtimes.get("docker"):
        return "docker is not installed: install docker-ce or docker.io"
    if not runtimes["docker"].get("daemon"):
        return "the docker daemon does not answer: systemctl start docker"
    if "nvidia" not in runtimes["docker"].get("runtimes", []):
        return ("docker has no nvidia runtime: install nvidia-container-toolkit and run "
                "nvidia-ctk runtime configure --runtime=docker && systemctl restart docker")
    if not runtimes["docker"].get("nvidia_hook", True):
        return ("docker cannot hand the GPU over (--gpus needs nvidia-container-runtime-hook, which is not on the "
                "PATH): install nvidia-container-toolkit, then systemctl restart docker")
    return None


def plan_choice(ctx):
    """Image, model and memory: what ``invoke facts`` shows and deploy needs first."""
    try:
        gathered = {name: ctx.facts[name] for name in ("arch", "nvidia", "meminfo")}
    except FactError as exc:
        yield Check("GPU facts", ok=False, message=str(exc))
        return
    v = ctx.vars
    units = units_of(v, ctx.facts.get(UNITS_FACT))
    held = deployed_replicas(_declared(ctx, units), gathered["nvidia"]["gpus"])
    # our own replicas hold their memory now: the GPUs they were handed keep their utilization
    active = {ident.index for ident, state in units
              if state.get("ActiveState") in ("active", "activating", "reloading")}
    running = {uuid: utilization for index, gpus in held.items() if index in active
               for uuid, utilization in gpus.items()}
    try:
        choice = choose(gathered, v, running)
    except Refused as exc:
        yield Check("image, model and memory", ok=False, message=str(exc))
        return
    # a replica on the GPUs a deployed one holds keeps its index (its unit, container and port)
    keep_indices(choice.placement, {uuid: index for index, gpus in held.items() for uuid in gpus}, v)
    yield Decision("choice", produces=CHOICE, value=choice)
    yield Check("image", ok=True, message=f"{choice.image} ({choice.image_reason})")
    yield Check("model", ok=True, message=f"{choice.model} ({choice.model_reason})")
    for replica in choice.replicas:
        on = ", ".join(f"GPU {gpu['index']} ({gpu['uuid']})" for gpu in replica.gpus)
        yield Check("memory precheck" if len(choice.replicas) == 1 else f"memory precheck (replica {replica.index})",
                    ok=True, message=f"{replica.model}, gpu_memory_utilization {replica.utilization} on {on} "
                                     f"({replica.utilization_reason})")
    if choice.notes:
        yield Check("GPUs left out", ok=True, message="; ".join(choice.notes))


def _declared(ctx, units: list) -> dict[int, str]:
    """Replica index -> the text that declares it: its unit file, or its container in our
    NixOS module."""
    v = ctx.vars
    module = (ctx.facts.get("nixos_module") or {}).get("content")
    if module:
        found = {}
        for name, text in module_containers(module).items():
            ident = from_container(v, name)
            if ident is not None:
                found[ident.index] = text
        return found
    files = ctx.facts.get(UNITS_FACT) or {}
    return {ident.index: ((files.get(ident.unit_path) or {}).get("file") or {}).get("content", "")
            for ident, _ in units}


def plan(ctx):
    v, f = ctx.vars, ctx.facts
    if is_gateway(v):
        # a gateway refused is refused before its front door moves aside from api_port (serving.gateway_checks)
        refused = refusals(v, f, ctx.services.get("fleet"))
        if refused:
            yield from refused
            return
        # and one that cannot reach every front door, before its own moves aside (a dedicated
        # gateway asks in its own role, before anything changes there)
        yield reach_step(ctx.name, ctx.services.get("fleet").serving)
    ok = True
    for step in plan_choice(ctx):
        ok = ok and (not isinstance(step, Check) or step.ok)
        yield step
    if not ok:
        return
    systemd = f.get("systemd") or {}
    yield Check("systemd", ok=bool(systemd.get("present")),
                message=f"systemd {systemd.get('version')}, {systemd.get('state')}" if systemd.get("present") else
                "systemd is not running on this host: the toolkit installs systemd units")
    missing = [c for c, path in (f.get("commands") or {}).items() if path is None]
    yield Check("host tools", ok=not missing,
                message=f"missing {', '.join(missing)}: install coreutils, util-linux, curl and an awk" if missing
                else "")
    choice = ctx.results[CHOICE]
    runtime = v.get("container_runtime", "podman")
    problem = runtime_problem(runtime, f.get("runtimes") or {})
    yield Check(f"{runtime} GPU access", ok=problem is None, message=problem or "")
    if problem:
        return
    spec = catalog.models()["variants"].get(choice.model, {})
    need = spec.get("disk_mib", 0) + v.get("min_free_disk_mib", 2048)
    disk = f.get("disk_cache")
    have_weights = f.get("weights") or {}
    if disk and not weights_complete(have_weights, choice.model, v.get("model_revision", "main"))[0]:
        yield Check("disk space for weights", ok=disk["free_mib"] >= need,
                    message=(f"{disk['free_mib']} MiB free on {disk['mount']} for {disk['path']}" if
                             disk["free_mib"] >= need else
                             f"{disk['path']} ({disk['mount']}) has {disk['free_mib']} MiB free; {choice.model} "
                             f"needs {need} MiB: free space or set model_cache to a larger disk"))

def summary(ctx) -> dict:
    """What ``invoke facts`` shows: the host as read, and each choice with its reason."""
    f = ctx.facts
    out = {"facts": {}, "fact_errors": dict(f.errors) if f else {}}
    if f is None:
        return out
    nvidia = f.get("nvidia") or {}
    os_release = f.get("os") or {}
    meminfo = f.get("meminfo") or {}
    out["facts"] = {
        "arch": f.get("arch"),
        "os": os_release.get("PRETTY_NAME"),
        "driver_version": nvidia.get("driver_version"),
        "cuda_version": nvidia.get("cuda_version"),
        "gpus": nvidia.get("gpus", []),
        "compute_apps": nvidia.get("compute_apps", []),
        "mem_total_mib": round(meminfo["MemTotal"]) if "MemTotal" in meminfo else None,
        "mem_available_mib": round(meminfo["MemAvailable"]) if "MemAvailable" in meminfo else None,
        "runtimes": f.get("runtimes"),
        "systemd": f.get("systemd"),
        "disk": {"model_cache": f.get("disk_cache"), "images": f.get("disk_images")},
    }
    choice = ctx.results.get(CHOICE)
    out["choice"] = choice.as_dict() if choice else None
    # what a replica of this host is started with (inventory, group_vars, role defaults)
    out["diffusion"] = diffusion_wanted(ctx.vars)
    # each family's defaults for requests that set none (catalog, then generation_defaults)
    families = [r["family"] for r in (out["choice"] or {}).get("replicas") or []] or [DEFAULT_FAMILY]
    out["generation"] = {f: generation_wanted(ctx.vars, f) for f in dict.fromkeys(families)}
    return out


ROLE = Role("preflight", facts, plan, summary=summary, hosts=is_serving)
# `invoke facts`: the same facts and choice, without the deploy-only checks
FACTS_ROLE = Role("preflight", facts, plan_choice, summary=summary, hosts=is_serving)
