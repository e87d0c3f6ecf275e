#!/usr/bin/env python3
"""Where the usage service loses records: its CPU, the records it counted and those HAProxy could
not deliver to it (DroppedLogs), every half second, while wrk loads the gateway with limits (the
*no cost* pace: a replica that answers at once, so that only the proxies and the service cost
anything). On a folder that `bench/gateway/loopback.py prepare FOLDER` made:

    python3 bench/gateway/records.py FOLDER [--concurrency 64,256] [--seconds 8]

As root, as loopback.py runs: the service gets the role's records queue and niceness."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.gateway import loopback  # noqa: E402

TICKS = os.sysconf("SC_CLK_TCK")


def _stat(path: str) -> list[str]:
    """A /proc stat's fields after the command's name (state, ppid, ...)."""
    with open(path) as f:
        return f.read().rpartition(")")[2].split()


def _cpu(fields: list[str]) -> float:
    return (int(fields[11]) + int(fields[12])) / TICKS


def cpu_seconds(pid: int, task: str | None = None) -> float:
    """The user and system CPU seconds of a process (or one of its threads)."""
    return _cpu(_stat(f"/proc/{pid}/task/{task}/stat" if task else f"/proc/{pid}/stat"))


def family_cpu_seconds(pid: int) -> float:
    """A process's CPU seconds and its children's (the usage service's readers)."""
    total = cpu_seconds(pid)
    for name in os.listdir("/proc"):
        if name.isdigit() and name != str(pid):
            try:
                fields = _stat(f"/proc/{name}/stat")
                if fields[1] == str(pid):
                    total += _cpu(fields)
            except (OSError, IndexError, ValueError):
                pass  # ended between the listing and the read
    return total


def group_cpu_seconds(group: int) -> float:
    """The CPU seconds of every process of a process group (an HAProxy master and its workers)."""
    total = 0.0
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                fields = _stat(f"/proc/{name}/stat")
                if fields[2] == str(group):  # field 5, pgrp
                    total += _cpu(fields)
            except (OSError, IndexError, ValueError):
                pass  # ended between the listing and the read
    return total


def sample(pid: int, rows: list, stop: threading.Event, kind, every: float = 0.5):
    """(seconds since the start, the service's cores over the interval (its readers' included), counted, lost)
    each ``every``."""
    started = last_t = time.monotonic()
    last_cpu, last_counts = family_cpu_seconds(pid), loopback.usage_counts(kind)
    while not stop.wait(every):
        now, used, counts = time.monotonic(), family_cpu_seconds(pid), loopback.usage_counts(kind)
        rows.append((now - started, (used - last_cpu) / (now - last_t), counts[0] - last_counts[0],
                     counts[1] - last_counts[1]))
        last_t, last_cpu, last_counts = now, used, counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder loopback.py prepared")
    parser.add_argument("--concurrency", default="64,256")
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--kind", choices=sorted(loopback.KINDS), default="dedicated", help="which gateway (loopback.KINDS)")
    args = parser.parse_args()
    kind = loopback.KINDS[args.kind]
    folder = Path(args.folder)
    plan = json.loads((folder / "plan.json").read_text())
    url = f"https://127.0.0.1:{kind.limits}/v1/chat/completions"
    with loopback.Processes(folder, loopback.NO_COST, 1, None, plan.get("records_queue", 0),
                            plan.get("usage_nice", 0), plan.get("usage_readers", 0)) as processes:
        service = processes.usage[kind.name]
        rows, stop = [], threading.Event()
        sampler = threading.Thread(target=sample, args=(service.pid, rows, stop, kind))
        sampler.start()
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            began = len(rows)
            result = loopback.wrk(folder, url, concurrency, args.seconds, 4, "request.lua")
            time.sleep(2)  # the last records reach the service, and it reads HAProxy's count of those dropped
            busy = [r for r in rows[began:] if r[2] or r[3]]
            print(f"c={concurrency}: {result['requests'] / args.seconds:.0f} answers a second, machine "
                  f"{result['cpu_idle']:.0f}% idle; the service each half second: "
                  f"{min((r[1] for r in busy), default=0):.2f}-{max((r[1] for r in busy), default=0):.2f} cores, "
                  f"counted {min((r[2] for r in busy), default=0)}-{max((r[2] for r in busy), default=0)}, "
                  f"lost {min((r[3] for r in busy), default=0)}-{max((r[3] for r in busy), default=0)}", flush=True)
        stop.set()
        sampler.join()
        counted, lost, read = loopback.usage_counts(kind)
        print(f"in all: the gateway's HAProxy took {loopback.requests_taken(kind)} requests; the service counted "
              f"{counted}, read {read} lines of HAProxy's; HAProxy dropped {lost} lines", flush=True)
        threads = {task: cpu_seconds(service.pid, task) for task in os.listdir(f"/proc/{service.pid}/task")}
    print("seconds, service cores, counted, lost")
    for row in rows:
        print(f"{row[0]:6.1f} {row[1]:5.2f} {row[2]:7d} {row[3]:7d}")
    print("the service's threads, CPU seconds: " + ", ".join(f"{t} {s:.2f}" for t, s in sorted(threads.items())))


if __name__ == "__main__":
    main()
