#!/usr/bin/env python3
"""What the front door and the gateway add to a request: the same non-streaming chat
completion sent straight to vLLM on loopback, through the host's front door (TLS,
key check, allowlist), and through the fleet's gateway (TLS to it, then TLS to a
front door), p50 and p99 at concurrency 1 and 64.

The load runs on one serving host (its own python3; nothing is installed there), so
the direct call is a real loopback call. The stand-in's time per denoising step is
set to 0 for the run (a lab knob in the host's model cache) and put back after, so
the figures are the path's own cost. Run on a deployed lab:

    python3 bench/gateway/run.py [--host rtx01] [--requests 2000] [--write]

--write puts the table into docs/PERFORMANCE.md (between its gateway markers)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.toolkit import in_toolkit_env, write_section  # noqa: E402

in_toolkit_env()

import roles  # noqa: E402
from converge.play import Play  # noqa: E402
from roles.fleet import is_gateway  # noqa: E402
from roles.frontdoor.render import FRONTDOOR, GATEWAY  # noqa: E402
from roles.service.role import read_secret  # noqa: E402

KNOB_DIR = ".vllm-standin"
MARK_BEGIN = "<!-- bench/gateway: begin -->"
MARK_END = "<!-- bench/gateway: end -->"


def percentile(values, q):
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def knob_script(cache: str, on: bool) -> str:
    """The stand-in's time per denoising step set to 0 (on) or back to its own (off)."""
    knob = shlex.quote(f"{cache}/{KNOB_DIR}")
    return f"mkdir -p {knob} && echo 0 > {knob}/seconds-per-step\n" if on else f"rm -rf {knob}\n"


def runtime_api_script(commands: list[str]) -> str:
    """Commands to the gateway's HAProxy runtime API (its admin socket, root only), through
    the host's python3 (no socat needed)."""
    lines = "".join(f"{c}\n" for c in commands)
    sock = shlex.quote(f"{GATEWAY.socket_dir}/admin.sock")
    return (f"printf %s {shlex.quote(lines)} | python3 -c 'import socket, sys\n"
            f"for line in sys.stdin:\n"
            f"    s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); s.sendall(line.encode())\n"
            f"    print(s.recv(4096).decode().strip()); s.close()' {sock}\n")


def script(settings: dict) -> str:
    client = (Path(__file__).parent / "client.py").read_text()
    # the settings (the key among them) reach python3 on its stdin through printf, a shell
    # builtin: on no command line
    return (f"d=$(mktemp -d); trap 'rm -rf \"$d\"' EXIT\n"
            f"cat > \"$d/client.py\" <<'__CLIENT__'\n{client}__CLIENT__\n"
            f"printf '%s\\n' {shlex.quote(json.dumps(settings))} | python3 \"$d/client.py\"\n")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inventory", default=os.environ.get(roles.INVENTORY_VARIABLE, "/var/lib/dgemma-lab/inventory"))
    parser.add_argument("--host", default="rtx01", help="the serving host the load runs on")
    parser.add_argument("--requests", type=int, default=2000, help="requests per target and concurrency")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--write", action="store_true", help="write the table into docs/PERFORMANCE.md")
    args = parser.parse_args()
    play = Play.load(args.inventory, roles.schemas(), roles.defaults(), path_variable=roles.INVENTORY_VARIABLE)
    v = play.hostvars(args.host)
    gateways = [h for h in play.inventory.host_names if is_gateway(play.hostvars(h))]
    if not gateways:
        raise SystemExit("the inventory has no host in the group `gateway`")
    gw = play.hostvars(gateways[0])
    key = read_secret(v.get("api_key_file"), "api_key_file", args.host)
    if not key:
        raise SystemExit(f"{args.host}: the bench needs api_key_file (a key the front doors accept)")
    targets = [
        {"label": "direct (vLLM on loopback)", "kind": "direct", "tls": False, "connect": "127.0.0.1",
         "port": int(v.get("replica_base_port", 8100)), "name": args.host, "ca": ""},
        {"label": "front door (same host)", "kind": "frontdoor", "tls": True, "connect": "127.0.0.1", "port": int(v.get("api_port", 8000)),
         "name": args.host, "ca": f"{FRONTDOOR.dir}/ca.crt"},
        {"label": f"gateway ({gateways[0]})", "kind": "gateway", "tls": True, "connect": gw.get("ansible_host", gateways[0]),
         "port": int(gw.get("api_port", 8000)), "name": gateways[0], "ca": f"{FRONTDOOR.dir}/ca.crt"},
    ]
    # the one name every host serves: the gateway may send the request to any of them
    settings = {"key": key, "model": v.get("served_model_name", "diffusiongemma"), "targets": targets,
                "requests": args.requests, "concurrency": [int(c) for c in args.concurrency.split(",")]}
    rows = []
    # every serving host: the gateway sends the requests to any of them
    serving = [h for h in play.inventory.host_names if h not in gateways]
    with play.connections() as connections:
        # the gateway sends to the load's host alone for the run (the others in MAINT), so that
        # its figure compares with that host's direct call (spark01's stand-in runs under qemu)
        others = [h for h in serving if h != args.host]
        gateway_host = connections.get(gateways[0])
        try:
            gateway_host.run(runtime_api_script([f"set server servers/{h} state maint" for h in others]), timeout=60)
            for h in serving:
                connections.get(h).run(knob_script(play.hostvars(h).get("model_cache", "/srv/models/hf-cache"), True),
                                       timeout=60)
            result = connections.get(args.host).run(script(settings), timeout=3600)
            windows = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
            own = proxy_times(windows, connections.get(args.host), FRONTDOOR.unit_name(v),
                              gateway_host, GATEWAY.unit_name(gw))
        finally:
            gateway_host.run(runtime_api_script([f"set server servers/{h} state ready" for h in others]), timeout=60)
            for h in serving:
                connections.get(h).run(knob_script(play.hostvars(h).get("model_cache", "/srv/models/hf-cache"), False),
                                       timeout=60)
    if result.rc != 0:
        raise SystemExit(f"the load failed on {args.host} (exit {result.rc}): {result.stderr[-2000:]}")
    rows = windows
    table = report(rows) + "\n\n" + report_own(own)
    print(table)
    if args.write:
        write(table, args.host, gateways[0])
    if any(r["errors"] for r in rows):
        raise SystemExit("some requests failed: see the errors column")


TIMERS = re.compile(r" (-?\d+)/(-?\d+)/(-?\d+)/(-?\d+)/(\+?-?\d+) \d{3} ")


def own_ms(lines: list[str], path: str = "/v1/chat/completions") -> list[int]:
    """HAProxy's own time for each request in its access log (httplog: TR/Tw/Tc/Tr/Ta),
    ``Ta - Tr``: receiving the request, queueing, connecting, sending the answer; all
    of it but the server's time. A line logged twice (podman's log driver and the
    unit's stdout both reach the journal) counts once."""
    out = []
    for line in dict.fromkeys(lines):
        if f" {path} " not in line:
            continue
        found = TIMERS.search(line)
        if found:
            tr, ta = int(found.group(4)), int(found.group(5).lstrip("+"))
            if tr >= 0 and ta >= 0:
                out.append(ta - tr)
    return out


def proxy_times(windows: list[dict], host, host_unit: str, gateway, gateway_unit: str) -> list[dict]:
    """For each window of the front door and gateway paths, the proxies' own times from their logs."""
    def journal(connection, unit, window):
        cmd = (f"journalctl -u {shlex.quote(unit)} -o cat --no-pager --since @{window['since']:.3f} "
               f"--until @{window['until']:.3f}\n")
        return connection.run(cmd, timeout=120).stdout.splitlines()

    out = []
    for w in windows:
        if w["kind"] == "direct":
            continue
        row = {"target": w["target"], "concurrency": w["concurrency"],
               "front door": own_ms(journal(host, host_unit, w))}
        if w["kind"] == "gateway":
            row["gateway"] = own_ms(journal(gateway, gateway_unit, w))
        out.append(row)
    return out


def report_own(rows: list[dict]) -> str:
    """The proxies' own time per request, as HAProxy measured it (whole milliseconds)."""
    lines = ["| path | concurrency | proxy | requests logged | own time p50 ms | own time p99 ms |",
             "|---|---:|---|---:|---:|---:|"]
    for r in rows:
        for proxy in ("front door", "gateway"):
            if proxy in r:
                times = r[proxy]
                lines.append(f"| {r['target']} | {r['concurrency']} | {proxy} | {len(times)} | "
                             f"{percentile(times, 0.5):.0f} | {percentile(times, 0.99):.0f} |")
    return "\n".join(lines)


def report(rows: list[dict]) -> str:
    direct = {r["concurrency"]: r for r in rows if r["target"].startswith("direct")}
    lines = ["| path | concurrency | requests | p50 ms | p99 ms | added p50 ms | added p99 ms | errors |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p50, p99 = percentile(r["latencies"], 0.5) * 1000, percentile(r["latencies"], 0.99) * 1000
        base = direct.get(r["concurrency"])
        b50 = percentile(base["latencies"], 0.5) * 1000 if base else 0
        b99 = percentile(base["latencies"], 0.99) * 1000 if base else 0
        added = ("-", "-") if r is base else (f"{p50 - b50:.2f}", f"{p99 - b99:.2f}")
        lines.append(f"| {r['target']} | {r['concurrency']} | {len(r['latencies'])} | {p50:.2f} | {p99:.2f} | "
                     f"{added[0]} | {added[1]} | {len(r['errors'])} |")
    return "\n".join(lines)


def write(table: str, host: str, gateway: str):
    section = (f"{MARK_BEGIN}\n## The front door and the gateway: what they add to a request\n\n"
               f"`python3 bench/gateway/run.py --write`, {time.strftime('%Y-%m-%d')}, on {platform.node()} "
               f"({os.cpu_count()} cores), the lab deployed. The load runs on {host} (its python3, one kept-alive "
               f"connection per client, non-streaming chat completions of 16 tokens); the stand-in's time per "
               f"denoising step is 0, so each figure is the path's own cost. *Added* is the path minus the direct "
               f"loopback call at the same concurrency. The gateway path crosses the lab network to {gateway}, "
               f"then TLS again to {host}'s front door (the other servers are in MAINT for the run, through the "
               f"gateway's runtime API, so that the figure compares with {host}'s direct call). On 2 cores the load "
               f"generator (Python threads), the Python stand-in and HAProxy share the CPUs: at concurrency 64 the "
               f"figures measure that contention more than the path. The second table is each proxy's own time per "
               f"request from its access log (`Ta - Tr`: all but the time waiting for the server, whole "
               f"milliseconds), free of the load generator's share of the CPUs.\n\n{table}\n{MARK_END}")
    write_section(MARK_BEGIN, MARK_END, section)


if __name__ == "__main__":
    main()
