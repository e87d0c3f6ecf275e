"""Glue for `invoke bench`: find each serving host's URL, key, model and GPU,
run the benchmark with progress, print the table beside the published figures."""
from __future__ import annotations

import json
import ssl
import urllib.request

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from serving import catalog
from serving.declared import is_diffusion, served_name

from . import benchmark as bench
from .endpoints import YOUR_KEY, api_key, endpoints

HOW_TO_READ = ("tok/s of a diffusion LM depends on output length: the cost is per 256-token canvas. "
               "Compare full-canvas figures with full-canvas figures; short answers pay a whole canvas for a few "
               "tokens, so their tok/s is low by design (seed 004).")


def _served_models(base_url: str, key: str | None) -> list[str] | None:
    """The models to bench through a host's front door: the first name its replicas answer to
    (the alias; the variant's id after it is the same model), or, where the front door lists
    the families of a host that serves several (each entry its own root), every one."""
    req = urllib.request.Request(f"{base_url}/models")
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=15, context=bench.TLS.get("context")) as resp:
            listed = [(m["id"], m.get("root")) for m in json.loads(resp.read())["data"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not listed:
        return None
    return [i for i, _ in listed] if all(i == root for i, root in listed) else [listed[0][0]]


def bench_hosts(play, hosts: list[str], json_path, csv_path, repeats: int, concurrency: int) -> bool:
    console = Console()
    hostvars = {h: play.hostvars(h) for h in hosts}
    doc = endpoints(hostvars)
    bench.TLS["context"] = ssl.create_default_context(cafile=doc["ca_file"])
    key, problem = api_key(hostvars, show=True)
    if problem or key == YOUR_KEY:
        console.print(f"[red]{problem or 'bench needs a key: set api_key_file in the inventory (a 0600 file)'}[/red]")
        return False
    rows = [{"host": h["host"], "base_url": h["url"]} for h in doc["hosts"]]
    # the aliases of autoregressive families: the seeds' figures are DiffusionGemma's alone
    autoregressive = {served_name(f, v) for v in hostvars.values() for f in catalog.models()["families"]
                      if not is_diffusion(f)}
    results, ok = [], True
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                  transient=True) as progress:
        for row in rows:
            models = _served_models(row["base_url"], key)
            if models is None:
                console.print(f"[red]{row['host']}: {row['base_url']}/models does not answer; "
                              f"run invoke start --hosts {row['host']}[/red]")
                ok = False
                continue
            gpu, replicas = _placed(play, row["host"])
            # each model through the host's front door (all its replicas), then each replica alone
            # when the host has several (with the name of its own family)
            runs = [(None, model) for model in models]
            if len(replicas) > 1:
                runs += [(index, name if len(models) > 1 else models[0]) for index, name in replicas]
            for replica, model in runs:
                label = (row["host"] if replica is None else f"{row['host']} #{replica}") + \
                    (f" {model}" if len(models) > 1 else "")
                task = progress.add_task(f"{label}: starting", total=None)
                result = bench.run_host(row["host"], row["base_url"], key, model, gpu, repeats, concurrency,
                                        progress=lambda text, t=task, h=label: progress.update(
                                            t, description=f"{h}: {text}"), replica=replica,
                                        diffusion=model not in autoregressive)
                progress.remove_task(task)
                results.append(result)
                ok = ok and not any(f.errors for f in result.figures)
    bench.write(results, json_path, csv_path)
    table = Table("host", "model", "scenario", "tok/s", "p50 s", "p95 s", "mean tokens", "errors", "published",
                  title="BENCH (through each front door, over all its replicas and each alone (#N); non-streaming, temperature 0, thinking off, warm-up excluded)",
                  title_justify="left")
    for r in results:
        for f in r.figures:
            table.add_row(r.host if r.replica is None else f"{r.host} #{r.replica}", r.model, f.scenario, f"{f.tok_per_s:.1f}", f"{f.latency_p50_s:.3f}",
                          f"{f.latency_p95_s:.3f}", f"{f.mean_output_tokens:.0f}", str(f.errors),
                          (r.published or {}).get(f.scenario.replace(f"concurrency_{concurrency}", "concurrency_4"),
                                                  "-") + (f" ({r.published['platform']})" if r.published else ""))
    console.print(table)
    console.print(HOW_TO_READ)
    console.print(f"written: {json_path}, {csv_path}")
    return ok


def _placed(play, host: str) -> tuple[str | None, list[int]]:
    """The GPU's name and the host's replicas, read by the engine's facts (one round trip)."""
    from converge import play as playlib
    from converge.report import Report
    from roles import LOCK_NAME
    from roles.preflight.role import FACTS_ROLE
    report = Report(quiet=True)
    playlib.run(play, [FACTS_ROLE], host, report=report, lock_name=LOCK_NAME)
    extra = report.extra.get(host) or {}
    gpus = (extra.get("facts") or {}).get("gpus") or []
    replicas = [(r["index"], served_name(r.get("family", "diffusiongemma"), play.hostvars(host)))
                for r in (extra.get("choice") or {}).get("replicas") or []]
    return (gpus[0]["name"] if gpus else None), replicas
