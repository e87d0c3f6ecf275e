"""docs/first-deploy-bench.png from docs/first-deploy-bench.json (run by run.py in the
fleet bench's venv, where matplotlib lives)."""
import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(path, out):
    data = json.loads(Path(path).read_text())
    sizes = sorted({r["hosts"] for r in data["results"]})
    ready = [statistics.median(r["seconds"] for r in data["results"] if r["hosts"] == n) for n in sizes]
    floor = [next(r["floor"] for r in data["results"] if r["hosts"] == n) for n in sizes]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(sizes, ready, marker="o", label="time to ready (ours)")
    ax.plot(sizes, floor, marker="o", linestyle="--", label="floor: distinct bytes / uplink + cold start")
    ax.plot(sizes, [f * 1.2 for f in floor], linestyle=":", color="grey", label="1.2x floor")
    ax.set_xticks(sizes)
    ax.set_xlabel("hosts needing the same variant")
    ax.set_ylabel("seconds")
    ax.set_ylim(bottom=0)
    ax.set_title(f"first deploy from empty caches, uplink {data['rate_mb_s']:g} MB/s, "
                 f"{data['size_mib']} MiB checkpoint")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
