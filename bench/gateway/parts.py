#!/usr/bin/env python3
"""What each part of the gateway's limits and counting costs it, where only the proxies cost
anything: the loopback bench's processes at its *no cost* pace (bench/gateway/loopback.py: an
HAProxy answers in the replica's place), and the gateway with limits started again for each
variant of its configuration, each the one the role renders with one part taken away. So it
shows where the gap to the gateway without limits goes, part by part, on the machine it runs on:

    python3 bench/gateway/loopback.py prepare DIR    # here: configurations, certificates, key
    python3 bench/gateway/parts.py DIR               # anywhere: python3 (stdlib), haproxy, wrk
    python3 bench/gateway/parts.py DIR --write       # the table into docs/PERFORMANCE.md

A variant is a bench's question, not a configuration to serve with: each takes away something the
gateway needs (its count, its reservation, the retries, the bodies it reads whole). Besides each
variant's requests a second and p50, the CPU each process took per request answered (HAProxy's,
all its threads; the usage service's, its reader processes included; a sink's, the socket that
takes the records in the service's place in one variant)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.gateway import loopback, records  # noqa: E402
from bench.toolkit import haproxy_program  # noqa: E402  (stdlib only, as loopback's `run`)

MARK_BEGIN = "<!-- bench/gateway parts: begin -->"
MARK_END = "<!-- bench/gateway parts: end -->"
PLAIN = "gateway without limits"
EVERYTHING = "everything"

# a record sink: what the usage service's socket would take, read and dropped at once
SINK = ("import socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)\n"
        "s.bind(sys.argv[1])\n"
        "b = bytearray(65536)\n"
        "while True:\n"
        "    s.recv_into(b)\n")


def _without(config: str, *patterns: str) -> str:
    """``config`` less its lines that match any of ``patterns``; each pattern must match a line
    (a pattern that matches nothing means the role's configuration changed under the bench)."""
    lines = config.splitlines()
    for pattern in patterns:
        if not any(re.search(pattern, line) for line in lines):
            raise SystemExit(f"bench/gateway/parts.py: no line of the gateway's configuration matches {pattern!r}: "
                             f"the role renders it otherwise now; update the variants")
    return "\n".join(line for line in lines if not any(re.search(p, line) for p in patterns)) + "\n"


def _replaced(config: str, old: str, new: str) -> str:
    if old not in config:
        raise SystemExit(f"bench/gateway/parts.py: the gateway's configuration has no {old!r}: the role renders it "
                         f"otherwise now; update the variants")
    return config.replace(old, new)


FILTER, READER = r"^\s*filter lua\.usage", r"^\s*http-request lua\.asks "
# what a request may spend read natively instead of by usage.lua's reader (which reads it as vLLM
# does: HAProxy's json_query takes the first of a repeated key, and sees neither n nor prompts)
NATIVE_READER = "    http-request set-var(txn.tok_need) req.body,json_query('$.max_tokens') if key_ok generates"
RECORD = r"^\s*log unix@"
BIG_BUFFERS = "tune.bufsize 131072"
RETRIES = "retry-on conn-failure empty-response 503"


def _native_reader(config: str) -> str:
    """``config`` with its one call to usage.lua's reader replaced by NATIVE_READER."""
    lines = config.splitlines()
    at = [i for i, line in enumerate(lines) if re.search(READER, line)]
    if len(at) != 1:
        raise SystemExit(f"bench/gateway/parts.py: {len(at)} lines of the gateway's configuration match {READER!r}: "
                         f"the role renders it otherwise now; update the variants")
    lines[at[0]] = NATIVE_READER
    return "\n".join(lines) + "\n"


def variants(config: str, sink: Path) -> dict[str, tuple[str, str]]:
    """Each variant's name -> (what it takes away, its configuration)."""
    record = re.search(r"log unix@(\S+)", config)
    if record is None:
        raise SystemExit("bench/gateway/parts.py: the gateway's configuration sends no record (log unix@...)")
    no_lua = _native_reader(_without(config, FILTER))
    no_lua_no_record = _without(no_lua, RECORD)
    return {
        EVERYTHING: ("nothing: as the role renders it", config),
        "records to a sink": ("the usage service: its records go to a socket that reads and drops them",
                              config.replace(f"log unix@{record.group(1)}", f"log unix@{sink}")),
        "no record": ("the record (the log line to the usage service)", _without(config, RECORD)),
        "no L7 retries": ("the retries on an empty answer and a 503 (each request's 128 KiB buffer copied "
                          "before it is sent, to send it again)", _replaced(config, RETRIES, "retry-on conn-failure")),
        "16 KiB buffers": ("the 128 KiB buffers (HAProxy's default instead: bodies past 16 KiB are not read whole)",
                           _replaced(config, BIG_BUFFERS, "tune.bufsize 16384")),
        "no filter": ("the usage filter (the answer's usage read as it passes, the stream reshaped)",
                      _without(config, FILTER)),
        "native reader": ("usage.lua's reader of what a request may spend: json_query's max_tokens instead",
                          _native_reader(config)),
        "no Lua": ("the filter, and the reader native", no_lua),
        "no Lua + no record": ("the filter, the reader native, and the record", no_lua_no_record),
        "no Lua + no record + 16 KiB": ("all of the above, and the 128 KiB buffers: the limits' native rules alone",
                                      _replaced(no_lua_no_record, BIG_BUFFERS, "tune.bufsize 16384")),
    }


def _config_of(limits: Path, name: str) -> Path:
    """Where a variant's configuration is written, beside the gateway's own."""
    return limits / f"parts-{re.sub(r'[^a-z0-9]+', '-', name.lower())}.cfg"


def _start_gateway(folder: Path, kind: loopback.Kind, config: Path, procs: loopback.Processes,
                   haproxy_args: list[str]) -> subprocess.Popen:
    with open(folder / f"{kind.limits_dir}.log", "a") as log:  # HAProxy keeps its own copy of the descriptor
        proc = subprocess.Popen([haproxy_program(), "-W", "-db", *haproxy_args, "-f", str(config)],
                                env={**os.environ, "GATEWAY_KEY": loopback.GATEWAY_KEY},
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    procs.procs.append(proc)
    loopback._wait_port(kind.limits, proc, f"the {kind.name} gateway with limits")
    return proc


def _stop(proc: subprocess.Popen):
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(10)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def run(folder: Path, seconds: int, concurrency: int, rounds: int, threads: int, only: list[str] | None) -> dict:
    if not haproxy_program():
        raise SystemExit("bench/gateway/parts.py needs HAProxy: invoke lab.haproxy unpacks the 3.0 LTS the tests run "
                         "(or set DGEMMA_HAPROXY to one)")
    if not shutil.which("wrk"):
        raise SystemExit("bench/gateway/parts.py needs wrk on PATH (Debian: apt-get install wrk)")
    plan = json.loads((folder / "plan.json").read_text())
    if set(plan.get("kinds", ())) != set(loopback.KINDS):
        raise SystemExit(f"{folder}: prepared by another version of the bench: run bench/gateway/loopback.py prepare again")
    every, chosen = {}, []
    for kind in loopback.KINDS.values():
        limits = folder / kind.limits_dir
        every[kind.name] = variants((limits / "haproxy.cfg").read_text(), limits / "sink.sock")
        chosen = [name for name in every[kind.name] if only is None or name in only]
        unknown = sorted(set(only or ()) - set(every[kind.name]))
        if unknown:
            raise SystemExit(f"--only: no variant {', '.join(unknown)}; there are: {', '.join(every[kind.name])}")
        for name in chosen:
            _config_of(limits, name).write_text(every[kind.name][name][1])
    rows = []
    sinkers = []
    try:
        for kind in loopback.KINDS.values():
            sink = folder / kind.limits_dir / "sink.sock"
            sink.unlink(missing_ok=True)
            sinkers.append(subprocess.Popen([sys.executable, "-c", SINK, str(sink)], start_new_session=True))
        with loopback.Processes(folder, loopback.NO_COST, plan["replicas"], None, plan.get("records_queue", 0),
                                plan.get("usage_nice", 0), plan.get("usage_readers", 0)) as procs:
            # as loopback.Processes starts them: the replicas, the front door, then each kind's gateway
            # without limits, its usage service and its gateway with limits
            started = procs.procs[plan["replicas"] + 1:]
            running = {kind.name: started[3 * i: 3 * i + 3] for i, kind in enumerate(loopback.KINDS.values())}
            for number in range(1, rounds + 1):
                for kind, sinker in zip(loopback.KINDS.values(), sinkers):
                    plain, usage, gateway = running[kind.name]
                    args = plan["kinds"][kind.name]["haproxy_args"]
                    for name in [PLAIN, *chosen]:
                        if name == PLAIN:
                            url, measured = f"https://127.0.0.1:{kind.plain}/v1/chat/completions", plain
                        else:
                            _stop(gateway)
                            gateway = _start_gateway(folder, kind, _config_of(folder / kind.limits_dir, name), procs, args)
                            running[kind.name][2] = gateway
                            time.sleep(1.5)  # its first health checks have passed
                            url, measured = f"https://127.0.0.1:{kind.limits}/v1/chat/completions", gateway
                        loopback.wrk(folder, url, min(concurrency, 4), 1, threads, "request.lua")  # warm
                        before = [records.group_cpu_seconds(p.pid) for p in (measured, usage, sinker)]
                        result = loopback.wrk(folder, url, concurrency, seconds, threads, "request.lua")
                        after = [records.group_cpu_seconds(p.pid) for p in (measured, usage, sinker)]
                        answered = max(result["requests"], 1)
                        cpu = {who: 1e6 * (b - a) / answered
                               for who, a, b in zip(("haproxy", "usage", "sink"), before, after)}
                        if name == PLAIN:
                            cpu["usage"] = cpu["sink"] = 0.0  # they serve the other gateway
                        rps = result["requests"] / (result["duration_us"] / 1e6)
                        rows.append({"kind": kind.name, "variant": name, "round": number, "rps": rps,
                                     "p50_ms": result["p50_us"] / 1000, "p99_ms": result["p99_us"] / 1000,
                                     "errors": result["errors"], "idle": result["cpu_idle"], "cpu_us": cpu})
                        print(f"{kind.name:>9} {name:>28} round {number}: {rps:8.0f} req/s p50 "
                              f"{result['p50_us'] / 1000:6.2f} ms errors {result['errors']} idle "
                              f"{result['cpu_idle']:3.0f}% CPU a request: HAProxy {cpu['haproxy']:6.1f} µs, usage "
                              f"service {cpu['usage']:5.1f} µs, sink {cpu['sink']:4.1f} µs", flush=True)
    finally:
        for sinker in sinkers:
            _stop(sinker)
    first = next(iter(every.values()))
    return {"machine": platform.node(), "cores": os.cpu_count(), "cpu": loopback._cpu_name(),
            "haproxy": loopback._version([haproxy_program(), "-v"]), "seconds": seconds, "concurrency": concurrency,
            "rounds": rounds, "threads": threads, "rows": rows,
            "kinds": {k.name: {"host": k.host, "threads": loopback._threads(folder / k.limits_dir / "haproxy.cfg")}
                      for k in loopback.KINDS.values()},
            "takes_away": {name: first[name][0] for name in chosen}}


def table(result: dict) -> str:
    """A row per variant, each kind of gateway side by side: its requests a second, their share of
    the same gateway without limits, its p50, HAProxy's and the usage service's CPU a request."""
    rows = result["rows"]
    kinds = list(dict.fromkeys(r.get("kind", "dedicated") for r in rows))
    names = list(dict.fromkeys(r["variant"] for r in rows))

    def median(kind, name, pick):
        picked = [pick(r) for r in rows if r.get("kind", "dedicated") == kind and r["variant"] == name]
        return loopback._median(picked) if picked else None

    about = result.get("kinds", {})
    def threads(kind):
        given = about.get(kind, {}).get("threads", "?")
        return given if given == "every core" else f"{given} threads"

    head = "| variant | what it takes away | " + " | ".join(
        f"{k} ({threads(k)}): req/s | of without limits | p50 ms | "
        f"HAProxy CPU µs a request | usage service CPU µs a request | errors" for k in kinds) + " |"
    out = [head, "|---|---|" + "---:|---:|---:|---:|---:|---:|" * len(kinds)]
    for name in names:
        cells = []
        for kind in kinds:
            rps, plain = median(kind, name, lambda r: r["rps"]), median(kind, PLAIN, lambda r: r["rps"])
            if rps is None:
                cells.append("- | - | - | - | - | -")
                continue
            usage = median(kind, name, lambda r: r["cpu_us"]["usage"] + r["cpu_us"]["sink"])
            errors = sum(r["errors"] for r in rows if r.get("kind", "dedicated") == kind and r["variant"] == name)
            cells.append(f"{rps:.0f} | {100 * rps / plain:.0f}% | {median(kind, name, lambda r: r['p50_ms']):.2f} | "
                         f"{median(kind, name, lambda r: r['cpu_us']['haproxy']):.1f} | {usage:.1f} | {errors}")
        away = "(the reference)" if name == PLAIN else result["takes_away"].get(name, "")
        out.append(f"| {name} | {away} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def write(result: dict):
    from bench.toolkit import write_section
    text = (f"{MARK_BEGIN}\n### Where the gateway's limits go, part by part\n\n"
            f"`python3 bench/gateway/parts.py` ({time.strftime('%Y-%m-%d')}), {result['cores']} cores: {result['cpu']} "
            f"({result['machine']}), {result['haproxy']}. The loopback bench's *no cost* pace (an HAProxy answers in "
            f"the replica's place), wrk at concurrency {result['concurrency']} ({result['threads']} thread), "
            f"{result['seconds']} s a row, {result['rounds']} round(s) interleaved (medians), each kind of gateway "
            f"(the loopback bench's: dedicated, and serving with its threads set apart) side by side. Each variant is "
            f"the gateway with limits as deploy renders it, less one part: a bench's question, not a configuration "
            f"to serve with. CPU a request: the process's user and system time over the row, over the requests "
            f"answered (HAProxy's threads all together; the usage service's readers included, or the sink's in the "
            f"variant that sends the records there).\n\n{table(result)}\n\n{MARK_END}")
    write_section(MARK_BEGIN, MARK_END, text)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folder", help="a folder made by `bench/gateway/loopback.py prepare`")
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="wrk's threads")
    parser.add_argument("--only", help="these variants alone (comma-separated)")
    parser.add_argument("--json", help="write the figures as JSON to this file")
    parser.add_argument("--results", help="the figures of an earlier run (its --json), for --write, instead of running")
    parser.add_argument("--write", action="store_true", help="put the table into docs/PERFORMANCE.md")
    args = parser.parse_args()
    folder = Path(args.folder).resolve()
    if args.results:
        result = json.loads(Path(args.results).read_text())
    else:
        if not (folder / "plan.json").exists():
            raise SystemExit(f"{folder}: not prepared: run bench/gateway/loopback.py prepare {args.folder} first")
        result = run(folder, args.seconds, args.concurrency, args.rounds, args.threads,
                     args.only.split(",") if args.only else None)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.write:
        write(result)
    if any(r["errors"] for r in result["rows"]):
        raise SystemExit("some requests failed: see the errors column")


if __name__ == "__main__":
    main()
