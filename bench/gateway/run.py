#!/usr/bin/env python3
"""What the front door and the gateway add to a request: the same non-streaming chat
completion sent straight to vLLM on loopback, through the host's front door (TLS,
key check, allowlist), and through the fleet's gateway (TLS to it, then TLS to a
front door), p50 and p99 at concurrency 1 and 64.

The load comes from wrk (C, one event loop: a Python load generator spent more of the
2 cores than the path it measured), run in the serving host's own network namespace,
so the direct call is a real loopback call. The stand-in's time per denoising step is
set to 0 for the run (a lab knob in the host's model cache) and put back after, so the
figures are the path's own cost. Run as root on a deployed lab:

    python3 bench/gateway/run.py [--host rtx01] [--seconds 10] [--write]

--write puts the table into docs/PERFORMANCE.md (between its gateway markers)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.toolkit import cpu_times, haproxy_timers, in_toolkit_env, percentile, write_section  # noqa: E402

in_toolkit_env()

import roles  # noqa: E402
from converge.play import Play  # noqa: E402
from lab import config as lab_config  # noqa: E402
from serving.fleet import is_gateway  # noqa: E402
from serving.haproxy.instance import FRONTDOOR, GATEWAY  # noqa: E402
from serving.replicas import replica  # noqa: E402
from converge.secrets import read_optional_secret as read_secret  # noqa: E402

KNOB_DIR = ".vllm-standin"
MARK_BEGIN = "<!-- bench/gateway: begin -->"
MARK_END = "<!-- bench/gateway: end -->"


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


def lua_string(text: str) -> str:
    """``text`` as a Lua long string, whatever it holds."""
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    return f"[{'=' * level}[{text}]{'=' * level}]"


def wrk_script(key: str, model: str) -> str:
    """wrk's script: the request (the key in its header: the script is a 0600 file, so the key
    is on no command line) and one JSON line of what wrk measured (HdrHistogram, microseconds)."""
    body = json.dumps({"model": model, "max_tokens": 16, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hi."}],
                       "chat_template_kwargs": {"enable_thinking": False}})
    return (f"wrk.method = \"POST\"\n"
            f"wrk.body = {lua_string(body)}\n"
            f"wrk.headers[\"Content-Type\"] = \"application/json\"\n"
            f"wrk.headers[\"Authorization\"] = {lua_string('Bearer ' + key)}\n"
            "done = function(summary, latency, requests)\n"
            "  local e = summary.errors\n"
            "  io.write(string.format('{\"requests\": %.0f, \"errors\": %.0f, \"p50_us\": %.0f, "
            "\"p99_us\": %.0f, \"max_us\": %.0f, \"duration_us\": %.0f}\\n', summary.requests, "
            "e.connect + e.read + e.write + e.status + e.timeout, latency:percentile(50), "
            "latency:percentile(99), latency.max, summary.duration))\n"
            "end\n")


def load(netns: str, script: Path, url: str, concurrency: int, seconds: int) -> dict:
    """One wrk run from the host's network namespace: one thread, ``concurrency`` kept-alive
    connections, each sending its next request as soon as the last is answered."""
    idle0, total0 = cpu_times()
    since = time.time()
    run = subprocess.run(["ip", "netns", "exec", netns, "wrk", "-t1", f"-c{concurrency}", f"-d{seconds}s",
                          "--timeout", "30s", "-s", str(script), url], capture_output=True, text=True)
    until = time.time()
    idle1, total1 = cpu_times()
    found = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not found:
        raise SystemExit(f"wrk against {url} failed (exit {run.returncode}): {(run.stderr or run.stdout)[-1000:]}")
    out = json.loads(found[-1])
    out.update(since=since, until=until, cpu_idle=100 * (idle1 - idle0) / max(total1 - total0, 1))
    return out


def need_wrk():
    """Debian's wrk, installed on first need (as the fleet benchmark installs its tools)."""
    if shutil.which("wrk"):
        return
    print("installing Debian's wrk (the load generator) ...", file=sys.stderr)
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    if subprocess.run(["apt-get", "install", "-y", "-q", "wrk"], env=env, capture_output=True).returncode != 0 \
            or not shutil.which("wrk"):
        raise SystemExit("bench/gateway needs wrk: apt-get install wrk (as root), then run it again")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inventory", default=os.environ.get(roles.INVENTORY_VARIABLE, "/var/lib/dgemma-lab/inventory"))
    parser.add_argument("--host", default="rtx01", help="the serving host the load runs on")
    parser.add_argument("--seconds", type=int, default=10, help="how long each path is loaded, per concurrency")
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
    try:
        netns = lab_config.host(args.host).netns
    except KeyError:
        netns = ""
    if not netns or not Path(f"/run/netns/{netns}").exists():
        raise SystemExit(f"{args.host}: not a host of the running lab (no network namespace {netns or '?'}): "
                         f"bench/gateway runs on the lab (invoke lab.up, invoke deploy)")
    need_wrk()
    targets = [
        ("direct (vLLM on loopback)", "direct", f"http://{replica(v, 0).address}"),
        ("front door (same host)", "frontdoor", f"https://127.0.0.1:{int(v.get('api_port', 8000))}"),
        (f"gateway ({gateways[0]})", "gateway",
         f"https://{gw.get('ansible_host', gateways[0])}:{int(gw.get('api_port', 8000))}"),
    ]
    levels = [int(c) for c in args.concurrency.split(",")]
    # the one name every host serves: the gateway may send the request to any of them
    model = v.get("served_model_name", "diffusiongemma")
    rows = []
    serving = [h for h in play.inventory.host_names if h not in gateways]
    with tempfile.TemporaryDirectory(prefix="bench-gateway-") as scratch, play.connections() as connections:
        script = Path(scratch) / "request.lua"
        script.touch(mode=0o600)
        script.write_text(wrk_script(key, model))
        # the gateway sends to the load's host alone for the run (the others in MAINT), so that
        # its figure compares with that host's direct call (spark01's stand-in runs under qemu)
        others = [h for h in serving if h != args.host]
        gateway_host = connections.get(gateways[0])
        try:
            gateway_host.run(runtime_api_script([f"set server servers/{h} state maint" for h in others]), timeout=60)
            for h in serving:
                connections.get(h).run(knob_script(play.hostvars(h).get("model_cache", "/srv/models/hf-cache"), True),
                                       timeout=60)
            for label, kind, url in targets:
                for concurrency in levels:
                    load(netns, script, f"{url}/v1/chat/completions", 1, 1)  # connections and caches warm
                    result = load(netns, script, f"{url}/v1/chat/completions", concurrency, args.seconds)
                    rows.append({"target": label, "kind": kind, "concurrency": concurrency, **result})
            own = proxy_times(rows, connections.get(args.host), FRONTDOOR.unit_name(v),
                              gateway_host, GATEWAY.unit_name(gw))
        finally:
            gateway_host.run(runtime_api_script([f"set server servers/{h} state ready" for h in others]), timeout=60)
            for h in serving:
                connections.get(h).run(knob_script(play.hostvars(h).get("model_cache", "/srv/models/hf-cache"), False),
                                       timeout=60)
    table = report(rows) + "\n\n" + report_own(own)
    print(table)
    if args.write:
        write(table, args.host, gateways[0], args.seconds)
    if any(r["errors"] for r in rows):
        raise SystemExit("some requests failed: see the errors column")


def own_ms(lines: list[str], path: str = "/v1/chat/completions") -> list[int]:
    """HAProxy's own time (``Ta - Tr``) for each request to ``path`` in its access log."""
    return [ta - tr for tr, ta in haproxy_timers(lines, path)]


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
    direct = {r["concurrency"]: r for r in rows if r["kind"] == "direct"}
    lines = ["| path | concurrency | requests | p50 ms | p99 ms | added p50 ms | added p99 ms | errors | CPU idle % |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        p50, p99 = r["p50_us"] / 1000, r["p99_us"] / 1000
        base = direct.get(r["concurrency"])
        added = ("-", "-") if r is base or not base else \
            (f"{p50 - base['p50_us'] / 1000:.2f}", f"{p99 - base['p99_us'] / 1000:.2f}")
        lines.append(f"| {r['target']} | {r['concurrency']} | {r['requests']} | {p50:.2f} | {p99:.2f} | "
                     f"{added[0]} | {added[1]} | {r['errors']} | {r['cpu_idle']:.0f} |")
    return "\n".join(lines)


def write(table: str, host: str, gateway: str, seconds: int):
    section = (f"{MARK_BEGIN}\n## The front door and the gateway: what they add to a request\n\n"
               f"`python3 bench/gateway/run.py --write`, {time.strftime('%Y-%m-%d')}, on {platform.node()} "
               f"({os.cpu_count()} cores), the lab deployed. The load is wrk (one thread, one kept-alive "
               f"connection per client, each sending its next request when the last is answered, {seconds} s per "
               f"row), run in {host}'s network namespace; non-streaming chat completions of 16 tokens; the "
               f"stand-in's time per denoising step is 0, so each figure is the path's own cost. *Added* is the "
               f"path minus the direct loopback call at the same concurrency. The gateway path crosses the lab "
               f"network to {gateway}, then TLS again to {host}'s front door (the other servers are in MAINT for "
               f"the run, through the gateway's runtime API, so that the figure compares with {host}'s direct "
               f"call). *CPU idle* is the whole machine's during the row: every lab host, the load generator and "
               f"the journal share its {os.cpu_count()} cores. At concurrency 64 a closed loop keeps the stand-in "
               f"busy (it is CPU-bound once its time per step is 0), so a path's *added* time there is the CPU "
               f"its proxies take from it, times the requests queued: the figure of a machine with no core to "
               f"spare, not of the path alone. The second table is each proxy's own time per request from its "
               f"access log (`Ta - Tr`: all but the time waiting for the server, whole milliseconds); journald "
               f"drops a unit's lines past its rate limit, so the lines logged are a sample.\n\n"
               f"{table}\n{MARK_END}")
    write_section(MARK_BEGIN, MARK_END, section)


if __name__ == "__main__":
    main()
