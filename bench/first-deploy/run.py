#!/usr/bin/env python3
"""Time to ready of a first deploy, from empty caches, beside its floor. One command
reproduces it (as root, on the lab machine):

    python3 bench/first-deploy/run.py [--sizes 1,2,4] [--rate-mb-s 50] [--size-mib 2048] [--runs 1]

For each size N, N lab hosts of one arch that need the same model variant (the
scale nodes: x86_64, H100 profile, BF16) lose their image and model cache, then
one `invoke deploy` brings them all to ready (the API answers). The lab's uplink
(the hub and the registry, as seen from the lab network) is throttled to
``--rate-mb-s``; the lab network itself is not. The hub serves a synthetic
checkpoint of ``--size-mib``.

Floor: the distinct bytes the hosts need (the image's layers and config for the
arch, the checkpoint's files) over the uplink's rate, plus the stand-in server's
cold start: no tool can be faster, however it spreads the bytes. The bytes that
crossed the uplink are counted by the uplink itself; GETs per blob by the hub's
and the registry's access logs.

Results: docs/first-deploy-bench.json, a section of docs/PERFORMANCE.md (between
its first-deploy markers; the fleet bench keeps it) and docs/first-deploy-bench.png.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))


def _fleet_bench():
    """The fleet bench's module: its venvs, and the toolkit's environment it goes on under."""
    spec = importlib.util.spec_from_file_location("fleet_run", ROOT / "bench/fleet/run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fleet = _fleet_bench()  # run under a python3 without the toolkit, this goes on under .venv

from lab import config, crossings, hubdata, machines, services  # noqa: E402

REPO = "google/diffusiongemma-26B-A4B-it"  # the H100 profile's variant (BF16)
IMAGE_REPO, IMAGE_TAG = "vllm/vllm-openai", "gemma-x86_64-cu130"
# the cold start its recorded results were measured with (the lab's own is config.COLD_START_S)
COLD_START_S = 5.0
BEGIN, END = "<!-- first-deploy: begin (bench/first-deploy/run.py) -->", "<!-- first-deploy: end -->"
GOAL = 1.2


def invoke(*args, check=True, env=None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "invoke", *map(str, args)], cwd=ROOT, text=True,
                          capture_output=True, env=env)
    if check and proc.returncode != 0:
        raise SystemExit(f"invoke {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def image_bytes() -> int:
    """The x86_64 image's manifest, config and layers as the registry stores them."""
    accept = ", ".join(["application/vnd.oci.image.manifest.v1+json",
                        "application/vnd.docker.distribution.manifest.v2+json"])
    url = f"http://{config.REGISTRY_LOCAL}/v2/{IMAGE_REPO}/manifests/{IMAGE_TAG}"
    with urllib.request.urlopen(urllib.request.Request(url, headers={"Accept": accept}), timeout=30) as resp:
        body = resp.read()
    manifest = json.loads(body)
    if "layers" not in manifest:
        raise SystemExit(f"{url}: expected one platform's manifest, got {manifest.get('mediaType')}")
    return len(body) + manifest["config"]["size"] + sum(layer["size"] for layer in manifest["layers"])


def checkpoint_bytes(size_mib: int) -> int:
    # built here, before any clock runs: the hub makes a checkpoint of a new size once
    return sum(f.size for f in hubdata.repo_files(REPO, size_mib, str(config.CACHE / "hub")))


def uplink_down() -> int:
    return sum(s.get("down", 0) for s in services.uplink_bytes().values())


def measure(hosts: list[str], distinct: int, rate_mb_s: float) -> dict:
    for name in hosts:
        machines.empty_caches(config.host(name))
    time.sleep(1)  # the uplink writes its counts every 0.2 s
    start, before = crossings.mark(), uplink_down()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "deploy.json"
        env = dict(os.environ, DGEMMA_INVENTORY=str(config.STATE / "inventory"))
        started = time.perf_counter()
        proc = invoke("deploy", "--hosts", ",".join(hosts), "--json", out, check=False, env=env)
        took = time.perf_counter() - started
        data = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0:
        raise SystemExit(f"deploy of {', '.join(hosts)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-2000:]}")
    time.sleep(1)
    seen = crossings.since(start)
    floor = distinct / (rate_mb_s * 1e6) + COLD_START_S
    return {"hosts": len(hosts), "seconds": round(took, 2), "floor": round(floor, 2),
            "ratio": round(took / floor, 3), "uplink_bytes": uplink_down() - before, "distinct_bytes": distinct,
            "hub_gets_per_file": sorted(set(seen.hub_files.values())),
            "registry_gets_per_blob": sorted(set(seen.registry_blobs.values())),
            "relay": data.get("relay", {})}


def section(data: dict) -> str:
    rows = data["results"]
    lines = [BEGIN, "", "## First deploy: time to ready from empty caches", "",
             f"Measured by `python3 bench/first-deploy/run.py` (as root, on the lab machine; {data['cores']} cores). "
             f"N scale nodes (x86_64, H100 profile: the BF16 variant), image and model cache removed, then one "
             f"`invoke deploy` until every API answers. The lab's uplink (hub and registry) at "
             f"{data['rate_mb_s']:g} MB/s, the lab network unthrottled; a synthetic checkpoint of "
             f"{data['size_mib']} MiB. Floor: distinct bytes ({data['distinct_bytes'] / 1e6:.0f} MB: image "
             f"{data['image_bytes'] / 1e6:.0f} MB, checkpoint {data['checkpoint_bytes'] / 1e6:.0f} MB) over the "
             f"uplink's rate, plus the stand-in server's cold start ({COLD_START_S:g} s). Uplink bytes: counted by "
             "the uplink itself (HTTP headers and the hub's API answers included). GETs per file or blob: from the "
             "hub's and the registry's access logs.", "",
             "| hosts | time to ready s (median, min-max) | floor s | ready / floor | bytes over the uplink MB | "
             "/ distinct bytes | GETs per hub file | GETs per registry blob | relay served MB |",
             "|---|---|---|---|---|---|---|---|---|"]
    for n in sorted({r["hosts"] for r in rows}):
        cell = [r for r in rows if r["hosts"] == n]
        times = [r["seconds"] for r in cell]
        median = statistics.median(times)
        up = max(r["uplink_bytes"] for r in cell)
        served = max(r["relay"].get("served_bytes", 0) for r in cell)
        lines.append(f"| {n} | {median:.1f} ({min(times):.1f}-{max(times):.1f}) | {cell[0]['floor']:.1f} | "
                     f"{median / cell[0]['floor']:.2f} | {up / 1e6:.0f} | {up / cell[0]['distinct_bytes']:.3f} | "
                     f"{', '.join(map(str, sorted({g for r in cell for g in r['hub_gets_per_file']})))} | "
                     f"{', '.join(map(str, sorted({g for r in cell for g in r['registry_gets_per_blob']})))} | "
                     f"{served / 1e6:.0f} |")
    lines += ["", f"Goal: time to ready within {GOAL}x of the floor, bytes over the uplink equal to the distinct "
              "bytes. With one host the run has no relay (nothing to share); with more, the control machine's "
              "relay fetches each file once and streams it to every host as it arrives (README, \"First deploy: "
              "each artifact once\").", "", "![first deploy](first-deploy-bench.png)", "", END]
    return "\n".join(lines) + "\n"


def write_docs(data: dict, docs: Path):
    (docs / "first-deploy-bench.json").write_text(json.dumps(data, indent=2) + "\n")
    perf = docs / "PERFORMANCE.md"
    old = perf.read_text() if perf.exists() else ""
    text = section(data)
    if BEGIN in old and END in old:
        new = old[:old.index(BEGIN)] + text + old[old.index(END) + len(END) + 1:]
    else:
        new = old.rstrip("\n") + "\n\n" + text
    perf.write_text(new)
    chart(data, docs)


def chart(data: dict, docs: Path):
    """The chart, drawn by the fleet bench's venv (matplotlib lives there, not in the toolkit)."""
    python = fleet.venv("pyinfra") / "bin/python"
    subprocess.run([str(python), str(HERE / "chart.py"), str(docs / "first-deploy-bench.json"),
                    str(docs / "first-deploy-bench.png")], check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="1,2,4")
    parser.add_argument("--rate-mb-s", type=float, default=50.0)
    parser.add_argument("--size-mib", type=int, default=2048)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--docs", default=str(ROOT / "docs"))
    parser.add_argument("--report-only", action="store_true", help="rewrite the docs from the JSON of a run")
    args = parser.parse_args()
    docs = Path(args.docs)
    if args.report_only:
        return write_docs(json.loads((docs / "first-deploy-bench.json").read_text()), docs)
    if os.geteuid() != 0:
        raise SystemExit("run as root on the lab machine (the lab needs it)")
    sizes = [int(s) for s in args.sizes.split(",")]
    if not sizes or min(sizes) < 1 or max(sizes) > 16 or not 0 < args.rate_mb_s <= 10000 or args.size_mib < 1:
        raise SystemExit("--sizes: 1..16 hosts each; --rate-mb-s: above 0; --size-mib: 1 or more")
    invoke("lab.up", "--hosts", max(sizes), "--cold-start", COLD_START_S)
    try:
        services.set_hub(size_mib=args.size_mib)
        image, checkpoint = image_bytes(), checkpoint_bytes(args.size_mib)
        services.set_uplink(rate_mb_s=args.rate_mb_s, stalled=False)
        data = {"cores": os.cpu_count(), "rate_mb_s": args.rate_mb_s, "size_mib": args.size_mib,
                "image_bytes": image, "checkpoint_bytes": checkpoint, "distinct_bytes": image + checkpoint,
                "results": []}
        nodes = [f"node{i:02d}" for i in range(1, max(sizes) + 1)]
        for n in sizes:
            for run in range(args.runs):
                row = measure(nodes[:n], image + checkpoint, args.rate_mb_s)
                print(f"{n} host(s), run {run + 1}: {row['seconds']:.1f} s, floor {row['floor']:.1f} s "
                      f"({row['ratio']:.2f}x), uplink {row['uplink_bytes'] / 1e6:.0f} MB of "
                      f"{row['distinct_bytes'] / 1e6:.0f} MB distinct", flush=True)
                data["results"].append(row)
    finally:
        services.set_uplink(rate_mb_s=0, stalled=False)
        services.set_hub()
        for name in (f"node{i:02d}" for i in range(1, max(sizes) + 1)):
            machines.empty_caches(config.host(name))
        invoke("lab.up")  # back to the default lab (its own cold start): the nodes' disks go
    write_docs(data, docs)


if __name__ == "__main__":
    main()
