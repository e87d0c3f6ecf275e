#!/usr/bin/env python3
"""What monitoring costs the fleet, on a deployed lab with a monitoring host:

1. CPU and memory of each host's exporters (the node exporter, the collector of ours with
   the nvidia-smi it runs) and of Prometheus and Alertmanager, at the inventory's scrape
   interval (15 s by default), from /proc over a window (CPU: a process's own time and its
   waited-for children's, so the collector counts the nvidia-smi it ran);
2. what a scrape adds to a request's latency: the same chat completion through a host's
   front door, loaded by wrk from the host's own network namespace, in rounds with
   Prometheus scraping and rounds with it stopped, interleaved; the stand-in's time per
   denoising step is 0 for the run, so a scrape's cost (vLLM's /metrics rendered on the
   replica's one event loop) is not hidden under the generation's.

    python3 bench/monitoring/run.py [--host rtx01] [--window 120] [--seconds 30] [--rounds 3] [--write]

The lab's GPU is a stand-in (a Python nvidia-smi): the collector's CPU here is mostly that
stand-in's start; on a real H100 one reading took 0.06 s of CPU (tests/fixtures/nvidia-smi/h100/
CAPTURES-2026-11-25.md). --write puts the tables into docs/PERFORMANCE.md."""
from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.toolkit import in_toolkit_env, percentile, write_section  # noqa: E402

in_toolkit_env()

import roles  # noqa: E402
from bench.gateway.run import knob_script, load, need_wrk, wrk_script  # noqa: E402
from converge.play import Play  # noqa: E402
from converge.secrets import read_optional_secret as read_secret  # noqa: E402
from lab import config as lab_config  # noqa: E402
from serving import container_unit  # noqa: E402
from serving.fleet import is_monitoring  # noqa: E402
from roles.monitoring.role import prometheus_container  # noqa: E402

MARK_BEGIN = "<!-- bench/monitoring: begin -->"
MARK_END = "<!-- bench/monitoring: end -->"
# the processes, by their command names (/proc/PID/comm: 15 characters at most): the
# upstream images' binaries (/bin/node_exporter...), and Debian's packages' (prometheus-node-exporter...)
PROCESSES = {"node exporter": ("node_exporter", "prometheus-node"), "Prometheus": ("prometheus",),
             "Alertmanager": ("alertmanager", "prometheus-aler")}
COLLECTOR_UNIT = "dgemma-metrics-collector.service"


def sample_script() -> str:
    """Each process of interest: its name, CPU ticks (own and waited-for children's) and
    resident memory; the collector by its unit's main process."""
    names = " ".join(comm for comms in PROCESSES.values() for comm in comms)
    return (f"hz=$(getconf CLK_TCK)\n"
            f"for comm in {names}; do for pid in $(pgrep -x \"$comm\"); do\n"
            f"  set -- $(cut -d')' -f2- /proc/$pid/stat); rss=$(awk '/^VmRSS/ {{print $2}}' /proc/$pid/status)\n"
            f"  echo \"$comm $pid ${{12}} ${{13}} ${{14}} ${{15}} $rss $hz\"\n"
            f"done; done\n"
            f"pid=$(systemctl show -p MainPID --value {COLLECTOR_UNIT} 2>/dev/null)\n"
            f"if [ -n \"$pid\" ] && [ \"$pid\" != 0 ]; then\n"
            f"  set -- $(cut -d')' -f2- /proc/$pid/stat); rss=$(awk '/^VmRSS/ {{print $2}}' /proc/$pid/status)\n"
            f"  echo \"collector $pid ${{12}} ${{13}} ${{14}} ${{15}} $rss $hz\"\n"
            f"fi\n")


def parse_sample(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 8 and all(f.isdigit() for f in fields[1:]):
            comm, pid, utime, stime, cutime, cstime, rss, hz = fields[0], *map(int, fields[1:])
            name = next((n for n, comms in PROCESSES.items() if comm in comms), comm)
            out[(name, pid)] = {"cpu_s": (utime + stime + cutime + cstime) / hz, "rss_mib": rss / 1024}
    return out


def cost(connections, hosts: list[str], window: int) -> list[dict]:
    def sample():
        return {h: parse_sample(connections.get(h).run(sample_script(), timeout=60).stdout) for h in hosts}

    first, started = sample(), time.monotonic()
    time.sleep(window)
    second, took = sample(), time.monotonic() - started
    rows = []
    for host in hosts:
        for (name, pid), now in sorted(second[host].items()):
            before = first[host].get((name, pid))
            if before is None:
                continue  # a process started within the window: its share is not this window's
            rows.append({"host": host, "process": name, "cpu_pct": 100 * (now["cpu_s"] - before["cpu_s"]) / took,
                         "rss_mib": now["rss_mib"]})
    return rows


def switch(mon, unit: str, running: bool, port: int):
    """Prometheus started (and answering) or stopped. Its unit allows 3 starts in 15 min, as a
    guard against a crash loop; these starts are ours, so the count is reset before each."""
    if running:
        script = (f"systemctl reset-failed {unit} 2>/dev/null; systemctl start {unit} || exit 1\n"
                  f"for i in $(seq 60); do curl -sf -o /dev/null http://127.0.0.1:{port}/-/ready && exit 0; "
                  "sleep 1; done; exit 1\n")
    else:
        script = f"systemctl stop {unit} && sleep 2\n"
    result = mon.run(script, timeout=120)
    if result.rc != 0:
        raise SystemExit(f"could not {'start' if running else 'stop'} {unit} on the monitoring host: "
                         f"{result.stderr.strip()[-500:]}")


def latency(connections, play, args, monitor: str) -> list[dict]:
    v = play.hostvars(args.host)
    key = read_secret(v.get("api_key_file"), "api_key_file", args.host)
    netns = lab_config.host(args.host).netns
    prom_unit = container_unit.unit_name(play.hostvars(monitor), prometheus_container(play.hostvars(monitor)))
    prom_port = int(play.hostvars(monitor).get("prometheus_port", 9090))
    mon = connections.get(monitor)
    host = connections.get(args.host)
    cache = v.get("model_cache", "/srv/models/hf-cache")
    url = f"https://127.0.0.1:{int(v.get('api_port', 8000))}/v1/chat/completions"
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-monitoring-") as scratch:
        script = Path(scratch) / "request.lua"
        script.touch(mode=0o600)
        script.write_text(wrk_script(key, v.get("served_model_name", "diffusiongemma")))
        host.run(knob_script(cache, True), timeout=60)
        try:
            load(netns, script, url, 1, 2)  # warm
            for round_ in range(args.rounds):
                for scraped in (True, False):
                    switch(mon, prom_unit, scraped, prom_port)
                    result = load(netns, script, url, args.concurrency, args.seconds)
                    rows.append({"round": round_ + 1, "scraped": scraped, **result})
        finally:
            switch(mon, prom_unit, True, prom_port)
            host.run(knob_script(cache, False), timeout=60)
    return rows


def report(costs: list[dict], rows: list[dict], args) -> str:
    lines = ["| host | process | CPU % of a core | memory (RSS) MiB |", "|---|---|---:|---:|"]
    for c in costs:
        lines.append(f"| {c['host']} | {c['process']} | {c['cpu_pct']:.2f} | {c['rss_mib']:.0f} |")
    lines += ["", "| rounds | Prometheus | requests | p50 ms (median of rounds) | p99 ms | max ms | errors |",
              "|---:|---|---:|---:|---:|---:|---:|"]
    for scraped in (True, False):
        mine = [r for r in rows if r["scraped"] is scraped]
        lines.append(f"| {len(mine)} | {'scraping every 15 s' if scraped else 'stopped'} | "
                     f"{sum(r['requests'] for r in mine)} | "
                     f"{percentile([r['p50_us'] / 1000 for r in mine], 0.5):.2f} | "
                     f"{percentile([r['p99_us'] / 1000 for r in mine], 0.5):.2f} | "
                     f"{max(r['max_us'] for r in mine) / 1000:.1f} | {sum(r['errors'] for r in mine)} |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inventory", default=os.environ.get(roles.INVENTORY_VARIABLE, "/var/lib/dgemma-lab/inventory"))
    parser.add_argument("--host", default="rtx01", help="the serving host whose front door the load goes to")
    parser.add_argument("--window", type=int, default=120, help="seconds over which the cost is measured")
    parser.add_argument("--seconds", type=int, default=30, help="seconds of each latency round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--write", action="store_true", help="write the tables into docs/PERFORMANCE.md")
    args = parser.parse_args()
    play = Play.load(args.inventory, roles.schemas(), roles.defaults(), path_variable=roles.INVENTORY_VARIABLE)
    monitors = [h for h in play.inventory.host_names if is_monitoring(play.hostvars(h))]
    if not monitors:
        raise SystemExit("the inventory has no host in the group `monitoring`: deploy one first")
    need_wrk()
    with play.connections() as connections:
        costs = cost(connections, list(play.inventory.host_names), args.window)
        rows = latency(connections, play, args, monitors[0])
    table = report(costs, rows, args)
    print(table)
    if args.write:
        section = (f"{MARK_BEGIN}\n## Monitoring: what it costs the fleet\n\n"
                   f"`python3 bench/monitoring/run.py --write`, {time.strftime('%Y-%m-%d')}, on {platform.node()} "
                   f"({os.cpu_count()} cores), the lab deployed with monitor01 scraping every 15 s. The first table is "
                   f"each process's CPU (its own and its waited-for children's: the collector counts the nvidia-smi "
                   f"it runs, here the lab's Python stand-in; on a real H100 a reading took 0.06 s of CPU, 0.6% of a "
                   f"core every 10 s, the default gpu_metrics_interval_s; the lab's spark01 reads every 60 s, as its "
                   f"stand-in runs under qemu) over {args.window} s, and its resident memory. The second is the same chat "
                   f"completion through {args.host}'s front door (wrk, {args.concurrency} kept-alive connections "
                   f"from the host's own network namespace, {args.seconds} s a round, the stand-in's time per step 0), "
                   f"in rounds with Prometheus scraping and rounds with it stopped, interleaved.\n\n"
                   f"{table}\n{MARK_END}")
        write_section(MARK_BEGIN, MARK_END, section)
    if any(r["errors"] for r in rows):
        raise SystemExit("some requests failed: see the errors column")


if __name__ == "__main__":
    main()
