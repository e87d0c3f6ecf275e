"""docs/PERFORMANCE.md and docs/fleet-bench.png from docs/fleet-bench.json.
Run by run.py inside the bench's own venv (matplotlib lives there, not in the toolkit)."""
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

GOAL = 1.25


def main(path, docs):
    data = json.loads(Path(path).read_text())
    docs = Path(docs)
    tools = [t for t in ("ours", "ours-podman", "pyinfra", "ansible") if t in data["scenarios"][0]["tools"]]
    rows, skipped = [], []
    for s in data["scenarios"]:
        floor = s["floor"]["median"]
        for tool in tools:
            t = s["tools"].get(tool, {"skipped": "not run"})
            if "skipped" in t:
                skipped.append(f"{tool} at {s['hosts']} hosts, {s['rtt_ms']:g} ms: {t['skipped']}")
                continue
            rows.append((s["hosts"], s["rtt_ms"], tool, t["first"], t["noop"], floor, t["peak_rss_mb"]))
    lines = ["# Performance: a no-op converge, beside ansible-core and pyinfra", "",
             f"Measured by `python3 bench/fleet/run.py` (as root, on the lab machine; {data['cores']} cores), "
             f"{data['runs']} no-op runs per cell, each tool's whole command timed from start to exit. Same hosts, "
             "same work (GPU facts, two directories, an environment file, a templated unit, an image check, the "
             "unit's enabled state), each idempotent. Peers in their own venvs with their speed settings "
             "(ansible: pipelining, ControlPersist 60s, forks 32, no fact gathering; pyinfra: --parallel 32). "
             "Link delay: `bench/fleet/proxy.py` holds every chunk for half the RTT each way (this kernel has no "
             "netem). Floor: `ssh host true` to every host in parallel, fresh connections. "
             "`ours` checks the image by reading podman's store index (`converge.facts.containers.ImagePresent`); "
             "`ours-podman` is the same run with the image check starting podman (`podman image exists`), as the "
             "peers' does, to show what that choice is worth.", "",
             "| hosts | RTT | tool | first converge s | no-op median s (min-max) | floor s | no-op / floor | "
             "ours faster by | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    ours_at = {(r[0], r[1]): r[4]["median"] for r in rows if r[2] == "ours"}
    for hosts, rtt, tool, first, noop, floor, rss in rows:
        ratio = noop["median"] / floor
        faster = "" if tool == "ours" else f"{noop['median'] / ours_at[(hosts, rtt)]:.2f}x"
        lines.append(f"| {hosts} | {rtt:g} ms | {tool} | {first:.2f} | {noop['median']:.2f} ({noop['min']:.2f}-"
                     f"{noop['max']:.2f}) | {floor:.2f} | {ratio:.2f} | {faster} | {rss} |")
    if skipped:
        lines += ["", "Not run: " + "; ".join(skipped) + "."]
    paired = [s for s in data["scenarios"] if s.get("interleaved")]
    if paired:
        lines += ["", "## Round by round", "",
                  "Cells measured with the runs interleaved (floor, then each tool, round after round: the "
                  "machine's drift falls on every side alike) also give each round's ratio; their median is "
                  "steadier than a ratio of medians on a noisy machine. `ours@REV` is our engine as it was at "
                  "REV (`--against REV`), on the same work and hosts.", "",
                  "| hosts | RTT | tool | no-op / floor, median of rounds | no-op / ours, median of rounds |",
                  "|---|---|---|---|---|"]
        for s in paired:
            floors = s["floor"]["runs"]
            ours = s["tools"].get("ours", {}).get("noop", {}).get("runs")
            for tool, t in s["tools"].items():
                if "noop" not in t:
                    continue
                runs = t["noop"]["runs"]
                by_floor = sorted(a / b for a, b in zip(runs, floors))
                vs_ours = "" if tool == "ours" or not ours else \
                    f"{sorted(a / b for a, b in zip(runs, ours))[len(runs) // 2]:.3f}"
                lines.append(f"| {s['hosts']} | {s['rtt_ms']:g} ms | {tool} | {by_floor[len(runs) // 2]:.3f} | "
                             f"{vs_ours} |")
    behind = [s for s in data["scenarios"] if "bastion" in s]
    if behind:
        lines += ["", "## Hosts behind a bastion", "",
                  "The same hosts reached through bastion01 (`-o ProxyJump=jump@bastion01`, the delay in front of "
                  "the bastion), beside their own floor: `ssh -J bastion host true` to every host in parallel "
                  "(each ssh its own connection to the bastion; ours shares one per run).", "",
                  "| hosts | RTT | first converge s | no-op median s (min-max) | floor through the bastion s | "
                  "no-op / floor | peak RSS MB |", "|---|---|---|---|---|---|---|"]
        for s in behind:
            b = s["bastion"]
            noop = b["ours"]["noop"]
            lines.append(f"| {s['hosts']} | {s['rtt_ms']:g} ms | {b['ours']['first']:.2f} | {noop['median']:.2f} "
                         f"({noop['min']:.2f}-{noop['max']:.2f}) | {b['floor']['median']:.2f} | "
                         f"{noop['median'] / b['floor']['median']:.2f} | {b['ours']['peak_rss_mb']} |")
    lines += ["", "## SSH round trips per host, one no-op run", "",
              "| tool | round trips per host (all) | connections per host | command round trips after the handshake "
              "(turns) | round trips waited for after the handshake (time) |",
              "|---|---|---|---|---|"]
    for tool, c in data["round_trips"].items():
        name = f"{tool} ({c['client']})" if "client" in c else tool
        lines.append(f"| {name} | {c['round_trips_per_host']} | {c['connections_per_host']} | "
                     f"{c.get('command_round_trips_after_handshake', '-')} | "
                     f"{c.get('waited_round_trips_after_handshake', '-')} |")
    lines += ["", "Counted by the proxy as changes of direction in each TCP connection (two per round trip). "
              "The handshake (key exchange and authentication) is taken away per SSH client: OpenSSH's is the "
              "floor's count (handshake and one `true`) less one; paramiko's (ours and pyinfra) is "
              "`paramiko-handshake`, our engine connecting and closing. paramiko authenticates in fewer round "
              "trips than OpenSSH (no `none` probe, no public-key query before signing). Turns also count messages "
              "nobody waits for (window adjustments, sshd's host-key notice, the closing exchange); the last column "
              "counts only the waits, from time: one host through a 200 ms link, (run - connect only) less the "
              "same at 0 ms, over 200 ms.",
              "", "![no-op converge](fleet-bench.png)", ""]
    # the hand-written analysis below the marker survives a new run
    marker = "<!-- analysis: kept when run.py rewrites this file -->"
    old = (docs / "PERFORMANCE.md").read_text() if (docs / "PERFORMANCE.md").exists() else ""
    analysis = old[old.index(marker):] if marker in old else marker + "\n"
    (docs / "PERFORMANCE.md").write_text("\n".join(lines) + "\n" + analysis)
    fig, axes = plt.subplots(1, len({r[1] for r in rows}), figsize=(11, 4.5), squeeze=False)
    for ax, rtt in zip(axes[0], sorted({r[1] for r in rows})):
        for tool in tools + ["floor"]:
            pts = sorted((r[0], r[5] if tool == "floor" else r[4]["median"]) for r in rows
                         if r[1] == rtt and (r[2] == tool or (tool == "floor" and r[2] == tools[0])))
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=tool,
                    linestyle="--" if tool == "floor" else "-")
        ax.set_title(f"no-op converge, {rtt:g} ms RTT")
        ax.set_xlabel("hosts")
        ax.set_ylabel("seconds (median)")
        ax.set_yscale("log")
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(docs / "fleet-bench.png", dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
