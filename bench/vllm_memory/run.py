"""What vLLM's own start-up memory check sees, beside what our precheck reads: rerun on
any machine with an NVIDIA GPU and PyTorch (the lent H100: see README.md here).

vLLM 0.33.0 (vllm/v1/worker/gpu_worker.py) takes its snapshot of free memory after its
process has made its CUDA context and its cuBLAS / cuBLASLt handles (a 16x16 mm and a
linear with bias, then gc and empty_cache); `request_memory` then refuses to start when
ceil(total x utilization) > that free memory. Our precheck reads nvidia-smi before vLLM
exists, so the memory the worker takes for itself before the snapshot is not yet used.
This measures it: for each case (idle; another process holding memory), nvidia-smi's free
memory as `invoke facts --local` reads it, then, in a fresh process doing what the worker
does before its snapshot, torch's free memory; the difference is what the precheck must
keep aside. It also says, per case, the largest utilization each would let through.

    python3 bench/vllm_memory/run.py --out result.json [--hold-gib 20]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 1 << 20

# what gpu_worker.py does before MemorySnapshot (init_device), on cuda:0
WORKER = r"""
import gc, json, torch
torch.cuda.set_device(0)
x = torch.ones(16, 16, dtype=torch.bfloat16, device="cuda:0")
torch.mm(x, x)
torch.nn.functional.linear(x, x, x[0])
del x
gc.collect()
torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info(0)
print(json.dumps({"free": free, "total": total}), flush=True)
input()  # hold the context while nvidia-smi looks
"""
HOLDER = r"""
import sys, torch
x = torch.empty(int(sys.argv[1]) << 30, dtype=torch.uint8, device="cuda:0")
print("held", flush=True)
input()
"""


def smi_free_mib() -> int:
    out = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=memory.free,memory.total",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True, check=True).stdout
    return int(out.split(",")[0])


def precheck_view() -> dict:
    """What `invoke facts --local` reads and chooses on this machine."""
    proc = subprocess.run([sys.executable, "-m", "invoke", "facts", "--local", "--json", "-",
                           "--set", "gpu_memory_utilization=auto"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    host = json.loads(proc.stdout)["hosts"]["localhost"]
    gpu = host["facts"]["gpus"][0]
    return {"memory_free_mib": gpu["memory_free_mib"], "memory_total_mib": gpu["memory_total_mib"],
            "auto_utilization": (host.get("choice") or {}).get("gpu_memory_utilization")}


def largest(free_bytes: float, total_bytes: float) -> float:
    """The largest utilization (two decimals) with ceil(total x u) <= free."""
    u = math.floor(free_bytes / total_bytes * 100) / 100
    while u > 0 and math.ceil(total_bytes * u) > free_bytes:
        u = round(u - 0.01, 2)
    return u


def case(name: str) -> dict:
    seen = precheck_view()
    worker = subprocess.Popen([sys.executable, "-c", WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    snap = json.loads(worker.stdout.readline())
    smi_with_worker = smi_free_mib()
    worker.stdin.write("\n")
    worker.stdin.flush()
    worker.wait(timeout=60)
    total = seen["memory_total_mib"] * MIB
    overhead = seen["memory_free_mib"] - snap["free"] / MIB
    return {"case": name, "nvidia_smi_free_mib": seen["memory_free_mib"], "total_mib": seen["memory_total_mib"],
            "vllm_snapshot_free_mib": round(snap["free"] / MIB, 1), "torch_total_mib": round(snap["total"] / MIB, 1),
            "nvidia_smi_free_with_worker_mib": smi_with_worker,
            "worker_takes_before_snapshot_mib": round(overhead, 1),
            "largest_util_by_nvidia_smi": largest(seen["memory_free_mib"] * MIB, total),
            "largest_util_vllm_accepts": largest(snap["free"], snap["total"]),
            "auto_utilization_chosen": seen["auto_utilization"]}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--hold-gib", type=int, default=20)
    args = parser.parse_args()
    rows = [case("idle")]
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(args.hold_gib)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    time.sleep(1)
    try:
        rows.append(case(f"another process holds {args.hold_gib} GiB"))
    finally:
        holder.stdin.write("\n")
        holder.stdin.flush()
        holder.wait(timeout=60)
    name = subprocess.run(["nvidia-smi", "-i", "0", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()
    import torch
    doc = {"gpu": name, "torch": torch.__version__, "cuda": torch.version.cuda,
           "lazy_loading": os.environ.get("CUDA_MODULE_LOADING", "(default: LAZY)"), "cases": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
