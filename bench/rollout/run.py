#!/usr/bin/env python3
"""A rolling deploy on the lab beside its floor: a setting that restarts vLLM
(`max_num_seqs`) changes on every replica of the fleet while 4 clients send
non-streaming chat completions through the gateway, then changes back.

The floor is what the same replicas cost with nothing around them: each restarted
with `systemctl restart` and waited for (/health, then /v1/models) one after
another, as `--serial 1` would, timed on the host itself. The rollout adds, per
replica, the drain, the unit write, the front door seeing it up again, the gate's
completion and checks, and the run's own facts and steps. Run as root on a
deployed lab:

    python3 bench/rollout/run.py [--write]

--write puts the table into docs/PERFORMANCE.md (between its rollout markers)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
HOSTS = "spark01,rtx01,h100-01,hgx01,gateway01"
SERVING = ("spark01", "rtx01", "h100-01", "hgx01")
MARK_BEGIN = "<!-- bench/rollout: begin -->"
MARK_END = "<!-- bench/rollout: end -->"
CHAT = {"model": "diffusiongemma", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


from bench.toolkit import in_toolkit_env, write_section  # noqa: E402

in_toolkit_env()

import roles  # noqa: E402
from lab import config  # noqa: E402
from serving.replicas import from_unit, unit_globs  # noqa: E402
from serving.serving_host import env_path  # noqa: E402
from tests.lab.conftest import LAB_INVENTORY, front_door, ssh  # noqa: E402


def deploy(*args) -> tuple[int, dict, float]:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "deploy.json"
        env = dict(os.environ, DGEMMA_INVENTORY=str(LAB_INVENTORY), COLUMNS="200")
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "invoke", "deploy", "--hosts", HOSTS, *args, "--json", out],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        took = time.monotonic() - started
        data = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0:
        raise SystemExit(f"invoke deploy {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}")
    return proc.returncode, data, took


def replicas(host) -> list[tuple[str, int]]:
    """(unit, loopback port) of each replica the host runs (serving/replicas.py names them)."""
    v = hostvars(host)
    out = ssh(host, f"for f in {' '.join(unit_globs(v))}; do [ -f \"$f\" ] && echo \"${{f##*/}}\"; done; true")
    return [(r.unit, r.port) for r in (from_unit(v, unit) for unit in out.stdout.split()) if r is not None]


def hostvars(host) -> dict:
    from converge.play import Play
    play = Play.load(str(LAB_INVENTORY), roles.schemas(), roles.defaults())
    return play.hostvars(host)


def restart_time(host, unit, port) -> float:
    """systemctl restart, then /health and /v1/models on loopback, timed on the host."""
    env = shlex.quote(env_path(hostvars(host)))
    script = (f"key=$(sed -n 's/^VLLM_API_KEY=//p' {env}); s=$(date +%s%N); "
              f"systemctl restart {unit}; until curl -fs -o /dev/null http://127.0.0.1:{port}/health && "
              f"printf 'header = \"Authorization: Bearer %s\"\\n' \"$key\" | curl -fs -K - -o /dev/null "
              f"http://127.0.0.1:{port}/v1/models; do sleep 0.1; done; echo $(( ($(date +%s%N) - s) / 1000000 ))")
    return int(ssh(host, script, timeout=600).stdout.split()[-1]) / 1000


class Load:
    """4 clients through the gateway for as long as the block lasts."""

    def __init__(self, clients=4):
        self.clients, self.stop, self.lock, self.outcomes = clients, threading.Event(), threading.Lock(), []
        self.key = (config.STATE / "secrets" / "api-key").read_text().strip()

    def _client(self):
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                status = front_door("gateway01", "/v1/chat/completions", self.key, CHAT, timeout=90,
                                    address=config.host("gateway01").address)[0]
            except OSError as exc:
                status = type(exc).__name__
            with self.lock:
                self.outcomes.append((time.monotonic() - started, status))

    def __enter__(self):
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)


def rollout(setting: int) -> dict:
    with Load() as load:
        _, data, took = deploy("--set", f"max_num_seqs={setting}")
    rolls = [t for h in data["hosts"].values() for t in h["tasks"]
             if t["task"].startswith("rolling restart")]
    out_of_service = [float(m.group(1)) for t in rolls if (m := re.search(r"out of service ([0-9.]+) s", t["message"]))]
    return {"setting": setting, "seconds": took, "run_seconds": data["seconds"], "rolled": len(rolls),
            "rolls_seconds": sum(t["seconds"] for t in rolls), "out_of_service": out_of_service,
            "requests": len(load.outcomes), "failed": sum(1 for _, s in load.outcomes if s != 200),
            "slowest": max((d for d, _ in load.outcomes), default=0.0)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="write the table into docs/PERFORMANCE.md")
    args = parser.parse_args()
    deploy()  # the lab's own settings, every replica ready
    floor = []
    for host in SERVING:
        for unit, port in replicas(host):
            floor.append((host, unit, restart_time(host, unit, port)))
            print(f"floor: {host} {unit} restarted and ready in {floor[-1][2]:.1f} s", flush=True)
    runs = [rollout(5), rollout(4)]
    for run in runs:
        print(json.dumps(run), flush=True)
    total_floor = sum(s for _, _, s in floor)
    rows = ["| rollout | replicas | time s | floor s | time / floor | out of service per replica, median s | "
            "requests through the gateway | failed | slowest request s |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        rows.append(f"| max_num_seqs -> {run['setting']} | {run['rolled']} | {run['seconds']:.1f} | {total_floor:.1f} "
                    f"| {run['seconds'] / total_floor:.2f} | {statistics.median(run['out_of_service']):.1f} | "
                    f"{run['requests']} | {run['failed']} | {run['slowest']:.1f} |")
    table = "\n".join(rows)
    print(table)
    result = {"floor": [{"host": h, "unit": u, "seconds": s} for h, u, s in floor], "runs": runs,
              "machine": f"{platform.node()} ({os.cpu_count()} cores)", "measured": time.strftime("%Y-%m-%d")}
    (ROOT / "bench" / "rollout" / "result.json").write_text(json.dumps(result, indent=1) + "\n")
    if args.write:
        write(table, floor)


def write(table: str, floor):
    each = ", ".join(f"{h} {u.split('.')[0].removeprefix('podman-').removeprefix('docker-')} {s:.1f}"
                     for h, u, s in floor)
    section = (f"{MARK_BEGIN}\n## A rolling deploy beside its floor\n\n"
               f"`python3 bench/rollout/run.py --write`, {time.strftime('%Y-%m-%d')}, on {platform.node()} "
               f"({os.cpu_count()} cores), the lab deployed (7 replicas on 4 hosts, gateway01 in front). A setting "
               f"that restarts vLLM changes on every replica, one replica of the fleet at a time (the default behind a "
               f"gateway), while 4 clients send non-streaming chat completions through the gateway; then it changes "
               f"back. *Time* is the whole `invoke deploy`, facts and every role included. The *floor* is the same "
               f"replicas restarted with `systemctl restart` and waited for (/health, /v1/models) one after another, "
               f"timed on each host, with nothing around them (s: {each}). What the rollout adds per replica: the "
               f"drain, the unit write, the gate's completion through the front door and its checks, and putting "
               f"it back; the stand-in's cold start is {config.COLD_START_S:g} s (about 140 s on real hardware, seed 000), so on real hosts the "
               f"ratio comes closer to 1.\n\n{table}\n{MARK_END}")
    write_section(MARK_BEGIN, MARK_END, section)


if __name__ == "__main__":
    main()
