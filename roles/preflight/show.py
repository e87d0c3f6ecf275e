"""The ``invoke facts`` view: a table per host and a JSON document."""
from __future__ import annotations

from rich.table import Table


def facts_document(report) -> dict:
    hosts = {}
    for host, recap in report.recap.items():
        extra = report.extra.get(host, {})
        failures = [t.message for t in report.tasks if t.host == host and t.status in ("failed", "unreachable")]
        hosts[host] = {"ok": not (recap.failed or recap.unreachable), **extra, "errors": failures}
    return {"hosts": hosts}


def _gpu_line(gpu: dict) -> str:
    total = gpu.get("memory_total_mib")
    mem = "memory [N/A] (unified)" if total is None else f"{gpu['memory_free_mib']} of {total} MiB free"
    return f"{gpu['index']}: {gpu['name']} (cc {gpu.get('compute_capability')}), {mem}"


def print_tables(report, data: dict, console):
    for host, info in data["hosts"].items():
        table = Table(title=f"{host}", show_header=False, title_justify="left", expand=False)
        table.add_column("what", style="bold")
        table.add_column("value")
        table.add_column("why", style="dim")
        facts = info.get("facts") or {}
        if facts:
            table.add_row("arch", str(facts.get("arch")), "uname -m")
            table.add_row("os", str(facts.get("os")), "")
            table.add_row("driver", str(facts.get("driver_version")), "nvidia-smi")
            table.add_row("CUDA", str(facts.get("cuda_version")), "nvidia-smi --version")
            for gpu in facts.get("gpus", []):
                table.add_row("GPU", _gpu_line(gpu), "nvidia-smi --query-gpu")
            table.add_row("host memory", f"{facts.get('mem_available_mib')} of {facts.get('mem_total_mib')} MiB "
                          f"available", "/proc/meminfo")
            rts = facts.get("runtimes") or {}
            names = [f"{n} {rts[n]['version']}" for n in ("podman", "docker") if rts.get(n)]
            table.add_row("runtimes", ", ".join(names) or "none", ", ".join(rts.get("cdi_specs", [])) or "")
        choice = info.get("choice")
        if choice:
            table.add_row("image", choice["image"], choice["image_reason"])
            table.add_row("model", choice["model"], choice["model_reason"])
            table.add_row("utilization", str(choice["gpu_memory_utilization"]), choice["utilization_reason"])
            if info.get("diffusion"):
                d = info["diffusion"]
                table.add_row("diffusion", f"canvas {d['canvas_length']}, {d['max_denoising_steps']} steps, "
                                           f"{d['diffusion_sampler']} {d['diffusion_entropy_bound']}",
                              "canvas_length, max_denoising_steps, diffusion_sampler, diffusion_entropy_bound "
                              "(set per host or group); invoke status shows each replica's in force")
            for family, settings in (info.get("generation") or {}).items():
                text = ", ".join(f"{k} {'none' if v is None else v}" for k, v in settings.items()) or "the checkpoint's"
                table.add_row(f"{family} defaults", text, "generation_defaults (catalog, then inventory): "
                                                          "for requests that set none")
            for replica in choice.get("replicas", []):
                gpus = ", ".join(f"{i} ({u})" for i, u in zip(replica["gpu_indices"], replica["gpus"]))
                tp = f", tensor parallel {replica['tensor_parallel_size']}" if replica["tensor_parallel_size"] > 1 else ""
                table.add_row(f"replica {choice['replicas'].index(replica)}",
                              f"GPU {gpus}{tp}, port {replica['port']}",
                              f"{replica['quantization'] or replica['model']} at {replica['gpu_memory_utilization']}")
            for skipped in choice.get("skipped_gpus", []):
                table.add_row("GPU left out", skipped["uuid"], skipped["reason"], style="yellow")
        for name, error in (info.get("fact_errors") or {}).items():
            table.add_row(f"error ({name})", error, "", style="red")
        for error in info.get("errors", []):
            table.add_row("refused", error, "", style="red")
        console.print(table)
