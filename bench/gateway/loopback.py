#!/usr/bin/env python3
"""What the front door and the gateway add to a request, without the lab: the vLLM
stand-in, the front door's HAProxy and the gateway's HAProxy as plain processes on
loopback, with the configurations the roles render (the same TLS, allowlist, key check
by sha256, retries and access log), loaded by wrk at concurrency 1, 64 and 256. So it
runs on any Linux machine with cores to spare (a real gateway host has them; the lab's
2 cores do not), e.g. the 16-core machine the device tool lends:

    python3 bench/gateway/loopback.py prepare DIR     # here: configurations, certificates, key
    python3 bench/gateway/loopback.py run DIR         # anywhere: python3 (stdlib), haproxy, wrk
    python3 bench/gateway/loopback.py --write         # both, here; the table into docs/PERFORMANCE.md

Three paces of the replica: *realistic* (the stand-in's own time per canvas, ~96 ms for an
answer, as it paces the lab), *at once* (the stand-in with time per step 0: one Python event
loop, ~1,400 answers a second, then the limit) and *no cost* (in the stand-in's place an HAProxy
that answers a fixed completion with its usage at once: only the proxies cost anything, so
their own saturation shows).
Each path's *added* time is the path minus the direct call at the same pace and
concurrency. What differs from the lab: HAProxy runs as the user that starts it (no
`user haproxy` drop) and logs to a file (the lab's to journald); the stand-in's GPU
check is bypassed (it measures HTTP here, not memory)."""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.toolkit import cpu_times, haproxy_program, haproxy_timers, percentile  # noqa: E402  (stdlib only: `run` needs no toolkit environment)

STANDIN = ROOT / "lab" / "stubs" / "vllm"
ROUTES = ROOT / "lab" / "stubs" / "vllm-routes.txt"
MARK_BEGIN = "<!-- bench/gateway loopback: begin -->"
MARK_END = "<!-- bench/gateway loopback: end -->"
KEY = "dgk-loopback-bench-user-key"  # a throwaway key of this bench's own CA and key list
GATEWAY_KEY = "dgk-loopback-bench-gateway-key"
VLLM_KEY = "loopback-bench-vllm-key"
MODEL = "diffusiongemma"
# the replica and the front door; each kind of gateway's are in KINDS
PORTS = {"direct": 18100, "frontdoor": 18000}
USAGE_SERVICE = ROOT / "serving" / "accounting" / "files" / "usage_service.py"
# the bench key's limits: every one checked on every request, none reached
BENCH_LIMITS = {"requests_per_minute": 100_000_000, "requests_at_once": 100_000, "tokens_per_day": 4_000_000_000}
NO_COST = "haproxy"
PACES = {"realistic": None, "at once": 0.0, "no cost": NO_COST}  # None: the stand-in's own time per step
# what the no-cost replica answers: vLLM's shape of a chat completion of 4 tokens, and its usage
NO_COST_ANSWER = {"id": "chatcmpl-loopback", "object": "chat.completion", "created": 0, "model": MODEL,
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi there, lab."},
                               "logprobs": None, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 12, "total_tokens": 16, "completion_tokens": 4}}


def no_cost_config(port: int) -> str:
    """An HAProxy that stands where a replica does and answers at once, as vLLM's routes answer: a
    chat completion with its usage, /health, /v1/models (the body is read first, as vLLM reads it)."""
    def quoted(data) -> str:
        return json.dumps(json.dumps(data, separators=(",", ":")))
    models = {"object": "list", "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "vllm",
                                          "root": MODEL, "parent": None, "max_model_len": 262144}]}
    return "\n".join([
        "global", "    log stdout format raw local0 err",
        "defaults", "    mode http", "    timeout client 30s", "    timeout server 30s", "    timeout connect 3s",
        "    timeout http-request 10s", "    option http-buffer-request",
        "frontend replica", f"    bind 127.0.0.1:{port}",
        '    http-request return status 200 content-type application/json string "{}" if { path /health }',
        f"    http-request return status 200 content-type application/json string {quoted(models)} if {{ path /v1/models }}",
        f"    http-request return status 200 content-type application/json string {quoted(NO_COST_ANSWER)} "
        "if { path /v1/chat/completions } { method POST }",
        '    http-request return status 404 content-type application/json string "{\\"detail\\":\\"Not Found\\"}"',
        ""])


FLEETS = Path(__file__).parent / "fleets"


@dataclass(frozen=True)
class Kind:
    """A kind of gateway the bench runs: the host it is rendered as, in its own fleet
    (fleets/NAME/hosts.yml, read as deploy reads an inventory), and its ports here. The gateway
    with limits is the one deploy renders (its port and its peers' are the fleet's); the one
    without is the reference its cost is measured against, a bench's question."""
    name: str
    host: str
    plain: int  # the same gateway without limits
    plain_stats: int  # its stats and Prometheus exporter (the role's 8405)
    limits: int  # as deploy renders it: the fleet's api_port
    peers: int  # the fleet's gateway_peers_port
    usage: int  # its usage service's /metrics (the role's 9466)
    stats: int

    @property
    def plain_dir(self) -> str:
        return f"{self.name}-gateway"

    @property
    def limits_dir(self) -> str:
        return f"{self.name}-gateway-limits"

    @property
    def plain_path(self) -> str:
        return f"front door + {self.name} gateway"

    @property
    def limits_path(self) -> str:
        return f"front door + {self.name} gateway, limits"


# a dedicated gateway (the group `gateway` alone: the built-in lab's) and a serving one (the small and
# two-machine labs': its threads and memory set apart, vLLM keeping the rest of the host)
KINDS = {"dedicated": Kind("dedicated", "gateway01", 18443, 18448, 18444, 18445, 18446, 18447),
         "serving": Kind("serving", "rtx01", 18453, 18458, 18454, 18455, 18456, 18457)}


def fleet_hostvars(kind: Kind) -> tuple[dict, dict]:
    """(the gateway host's variables, every host's) as deploy reads them from the kind's fleet
    (cli/runs.py load_play: the roles' schemas and defaults; group_names and all)."""
    import roles
    from converge.play import Play
    play = Play.load(str(FLEETS / kind.name), roles.schemas(), roles.defaults())
    problems = play.problems()
    if problems:
        raise SystemExit(f"bench/gateway/fleets/{kind.name}: " + "; ".join(problems))
    every = {name: play.hostvars(name) for name in play.inventory.host_names}
    v = every[kind.host]
    if (int(v.get("api_port", 0)), int(v.get("gateway_peers_port", 0))) != (kind.limits, kind.peers):
        raise SystemExit(f"bench/gateway/fleets/{kind.name}: {kind.host}'s api_port and gateway_peers_port must be "
                         f"the bench's {kind.limits} and {kind.peers} (loopback.py KINDS)")
    return v, every


def gateway_config(kind: Kind, v: dict, every: dict, limits: bool = True) -> str:
    """The kind's gateway configuration as the role renders it for its host (``v``, of the fleet
    ``every``: fleet_hostvars), with its limits, or the same less them (the reference), before
    ``localised``."""
    from roles.gateway.role import rendered_from
    from serving.fleet import fleet_of
    from serving.haproxy.config import render_config
    from serving.haproxy.instance import GATEWAY
    inputs = rendered_from(kind.host, v, fleet_of(every))
    if not limits:
        v, inputs = {**v, "api_port": kind.plain}, {**inputs, "accounting": None}
    return render_config(kind.host, v, generation=GENERATION, proxy=GATEWAY, **inputs)


def haproxy_args(v: dict) -> list[str]:
    """What a gateway's container adds to HAProxy's command line for a host of variables ``v``: the
    memory set apart for a gateway on a serving host (-m), as its unit runs it."""
    from serving.haproxy.instance import GATEWAY, set_apart
    bounds = set_apart(v, GATEWAY)
    return ["-m", str(bounds["memory_mib"])] if bounds else []


GENERATION = "loopback"  # what the bench's proxies answer as (deploy's: a digest of what they load)


def localised(config: str, files: Path, stats: int, usage: int) -> str:
    """A gateway configuration as the bench runs it, and nothing else changed: its files and sockets
    in ``files`` (the role's: the container's folder and /run/dgemma-gateway), HAProxy's stats and its
    usage service's /metrics on the bench's ports, and no drop to the user haproxy (the bench runs as
    whoever starts it)."""
    from serving.accounting import USAGE_PORT
    from serving.haproxy.instance import CONTAINER_DIR, GATEWAY
    out = config.replace("    user haproxy\n    group haproxy\n", "")
    out = out.replace(f"{CONTAINER_DIR}/", f"{files}/").replace(f"{GATEWAY.socket_dir}/", f"{files}/")
    out = out.replace(f"bind 127.0.0.1:{GATEWAY.metrics_port}\n", f"bind 127.0.0.1:{stats}\n")
    return out.replace(f"server usage 127.0.0.1:{USAGE_PORT}\n", f"server usage 127.0.0.1:{usage}\n")


def prepare(folder: Path, replicas: int = 1):
    """Render the front door's configuration and both kinds of gateway as deploy renders them for
    their hosts (KINDS), a throwaway fleet CA and certificates, the key list, and wrk's request
    script, into ``folder``."""
    from bench.gateway.run import wrk_script
    from credentials import ca as fleet_ca
    from serving.haproxy.instance import CONTAINER_DIR, FRONTDOOR
    from serving.haproxy.config import Server, render_config, render_keys
    from serving.replicas import replica
    folder.mkdir(parents=True, exist_ok=True)
    digests = {"bench": hashlib.sha256(KEY.encode()).hexdigest(),
               "gateway": hashlib.sha256(GATEWAY_KEY.encode()).hexdigest()}
    files = folder / "frontdoor"
    files.mkdir(exist_ok=True)
    _certificates(folder, files, "rtx01", fleet_ca)
    (files / "keys.sha256").write_text(render_keys(digests))
    servers = [Server(r.server, r.address, replica=r.index)
               for r in (replica({"replica_base_port": PORTS["direct"]}, i) for i in range(replicas))]
    config = render_config("rtx01", {"api_host": "127.0.0.1", "api_port": PORTS["frontdoor"]}, servers, GENERATION,
                           proxy=FRONTDOOR, files=str(files), socket=str(files / "admin.sock"),
                           admin=str(files / "admin-http.sock"))
    config = config.replace("    user haproxy\n    group haproxy\n", "").replace(f"{CONTAINER_DIR}/", f"{files}/")
    (files / "haproxy.cfg").write_text(config)
    _private(files)
    args = {kind.name: _prepare_gateway(folder, kind, digests["bench"], fleet_ca) for kind in KINDS.values()}
    # a user's key for the proxies; vLLM's own for the direct call (the front door swaps them)
    for name, key in (("request.lua", KEY), ("request-direct.lua", VLLM_KEY)):
        script = folder / name
        script.write_text(wrk_script(key, MODEL))
        script.chmod(0o600)
    from serving.accounting import RECORDS_QUEUE, USAGE_NICE, USAGE_READERS
    (folder / "plan.json").write_text(json.dumps({"replicas": replicas, "ports": PORTS,
                                                  "kinds": {k.name: {**asdict(k), "haproxy_args": args[k.name]}
                                                            for k in KINDS.values()},
                                                  "records_queue": RECORDS_QUEUE, "usage_nice": USAGE_NICE,
                                                  "usage_readers": USAGE_READERS}))


def _certificates(folder: Path, files: Path, host: str, fleet_ca):
    issued = fleet_ca.host_certificate(folder / "credentials", host, [host, "127.0.0.1"], make=True)
    (files / "tls.pem").write_text(issued.cert_pem + issued.key_pem)
    (files / "ca.crt").write_text(fleet_ca.ca_pem(folder / "credentials", make=True))
    # the metrics routes' key list and scrape targets: HAProxy opens both when it loads
    (files / "monitoring.sha256").write_text("")
    (files / "targets.json").write_text("[]\n")


def _private(files: Path):
    for path in files.iterdir():
        if path.is_file():
            path.chmod(0o600)


def _prepare_gateway(folder: Path, kind: Kind, digest: str, fleet_ca) -> list[str]:
    """The kind's gateway with each key's limits and counting (requests a minute, at once, tokens a
    day; the usage.lua filter, the peers' tables, the record of every request to the usage service),
    and the same without them; what its HAProxy's command line adds (haproxy_args)."""
    from serving import key_limits as limits
    from serving.accounting import lua
    from serving.haproxy.config import render_keys
    from serving.haproxy.instance import LIVE_ANSWERS, live_answers
    v, every = fleet_hostvars(kind)
    plain = folder / kind.plain_dir
    plain.mkdir(exist_ok=True)
    _certificates(folder, plain, kind.host, fleet_ca)
    (plain / LIVE_ANSWERS).write_text(live_answers())  # the guard of its checks, every gateway's
    (plain / "keys.sha256").write_text(render_keys({"bench": digest}))
    (plain / "haproxy.cfg").write_text(localised(gateway_config(kind, v, every, limits=False), plain,
                                                 kind.plain_stats, kind.usage))
    _private(plain)
    files = folder / kind.limits_dir
    files.mkdir(exist_ok=True)
    _certificates(folder, files, kind.host, fleet_ca)
    (files / LIVE_ANSWERS).write_text(live_answers())
    peer = fleet_ca.peer_certificate(folder / "credentials", kind.host, make=True)
    (files / "peer.pem").write_text(peer.cert_pem + peer.key_pem)
    (files / "peers-ca.crt").write_text(fleet_ca.ca_pem(folder / "credentials", make=True))
    (files / "keys.sha256").write_text(render_keys({"bench": digest}))
    (files / "keys.map").write_text(limits.keys_map({"bench": digest}))
    (files / "limits.map").write_text(limits.limits_map({"bench": limits.effective({}, BENCH_LIMITS)}))
    (files / "usage.lua").write_text(lua())
    (files / "haproxy.cfg").write_text(localised(gateway_config(kind, v, every), files, kind.stats, kind.usage))
    _private(files)
    return haproxy_args(v)


def _metrics(port: int) -> list[str]:
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        return resp.read().decode().splitlines()


def _total(lines: list[str], prefix: str) -> int:
    return int(sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix)))


def usage_counts(kind: Kind) -> tuple[int, int, int]:
    """From the kind's usage service's /metrics: the requests it counted for the bench key (every
    gateway record), the records HAProxy could not deliver to it (its DroppedLogs, which the service
    counts as lost), and the lines it read from HAProxy (records, and lines of connections that
    carried no request)."""
    lines = _metrics(kind.usage)
    return (_total(lines, 'dgemma_usage_requests_total{key="bench"'), _total(lines, "dgemma_usage_records_lost_total"),
            _total(lines, "dgemma_usage_records_read_total"))


def requests_taken(kind: Kind) -> int:
    """The requests the kind's gateway with limits took on its API front end (HAProxy's own count:
    each one logged, and so a record sent, wrk's unanswered ones at the end of a row included)."""
    return _total(_metrics(kind.stats), 'haproxy_frontend_http_requests_total{proxy="api"}')


# an access line's status and termination state (httplog's, and the gateway's record's access part)
TERMINATION = re.compile(r" -?\d+/-?\d+/-?\d+/-?\d+/\+?-?\d+ (\d{3}) \d+ \S+ \S+ ([A-Za-z-]{4}) ")


def logged_since(log: Path, offset: int) -> list[str]:
    """The lines a proxy logged from ``offset`` on."""
    with open(log, "rb") as handle:
        handle.seek(offset)
        return handle.read().decode("utf-8", "replace").splitlines()


def failed_by_state(lines: list[str], path: str = "/v1/chat/completions") -> dict[str, int]:
    """The requests to ``path`` among a proxy's logged ``lines`` that were not answered 2xx, by
    HAProxy's termination state and status ("SC-- 503": no server could take it)."""
    out: dict[str, int] = {}
    for line in dict.fromkeys(lines):
        if f" {path} " not in line:
            continue
        found = TERMINATION.search(line)
        if found and not (found.group(1).startswith("2") and found.group(2) == "----"):
            state = f"{found.group(2)} {found.group(1)}"
            out[state] = out.get(state, 0) + 1
    return out


def _wait_port(port: int, proc: subprocess.Popen, what: str, timeout: float = 30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited ({proc.returncode}): see its log in the bench folder")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit(f"{what} did not listen on 127.0.0.1:{port} within {timeout:.0f} s")


STANDIN_LAUNCHER = """
import importlib.machinery, importlib.util, sys
loader = importlib.machinery.SourceFileLoader("vllm_standin", sys.argv[1])
spec = importlib.util.spec_from_loader("vllm_standin", loader)
standin = importlib.util.module_from_spec(spec)
loader.exec_module(standin)
standin.OPTIONS_FILE = sys.argv[1] + "-serve-options.txt"  # the flags vLLM 0.33.0 has, beside it in lab/stubs
# no GPU check here: this bench measures the HTTP path (one 80 GiB GPU, idle, as the stand-in reads it)
standin.gpu_memory = lambda tensor_parallel_size=1: [("GPU-loopback", 80 << 30, 80 << 30, False)]
standin.check_arch = lambda: None
standin.main(sys.argv[2:])
"""


def placement(replicas: int, cores: int) -> dict[str, set[int]] | None:
    """``--pin``: disjoint CPUs for each part, so that none is preempted by another (a real
    gateway host runs no model; a serving host's vLLM has its own cores): a core per
    stand-in replica, then a quarter of the rest for each proxy, the rest for wrk. None
    when the machine has too few cores to split."""
    rest = cores - replicas
    if rest < 6:
        return None
    quarter = rest // 4
    first = replicas
    out = {f"vllm-{i}": {i} for i in range(replicas)}
    out["frontdoor"] = set(range(first, first + quarter))
    out["gateway"] = set(range(first + quarter, first + 2 * quarter))
    out["wrk"] = set(range(first + 2 * quarter, cores))
    return out


class Processes:
    """The stand-in replicas and both proxies, started for one pace and stopped after."""

    def __init__(self, folder: Path, pace: float | str | None, replicas: int, pins: dict | None = None,
                 records_queue: int = 0, usage_nice: int = 0, usage_readers: int = 0):
        self.folder, self.pace, self.replicas, self.procs, self.pins = folder, pace, replicas, [], pins or {}
        self.usage_readers = usage_readers  # the usage service's --readers, as the role's unit sets it (0: its own)
        self.records_queue = records_queue  # the usage service's --records-queue (0: the host's as it is)
        self.usage_nice = usage_nice  # and its unit's Nice= (as root alone: a user cannot go below 0)
        self.usage: dict[str, subprocess.Popen] = {}  # each kind's usage service

    def _start(self, name: str, args: list[str], env: dict, port: int, pin_as: str | None = None, nice: int = 0):
        log = open(self.folder / f"{name}.log", "w")
        cpus = self.pins.get(pin_as or name)

        def placed():
            if cpus:
                os.sched_setaffinity(0, cpus)
            if nice:
                os.setpriority(os.PRIO_PROCESS, 0, nice)

        proc = subprocess.Popen(args, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, preexec_fn=placed if cpus or nice else None)
        self.procs.append(proc)
        _wait_port(port, proc, name)

    def _start_kind(self, kind: Kind, haproxy_args: list[str]):
        """The kind's gateway without limits, its usage service, then its gateway with limits (the
        service first, as its unit is ordered: HAProxy sends it each request's record)."""
        self._start(kind.plain_dir, [haproxy_program(), "-W", "-db", *haproxy_args,
                                     "-f", str(self.folder / kind.plain_dir / "haproxy.cfg")],
                    {"GATEWAY_KEY": GATEWAY_KEY}, kind.plain, pin_as="gateway")
        limits = self.folder / kind.limits_dir
        shutil.rmtree(limits / "usage", ignore_errors=True)
        self._start(f"{kind.name}-usage", [
            sys.executable, str(USAGE_SERVICE), "--socket", str(limits / "usage.sock"),
            "--runtime-api", str(limits / "admin.sock"), "--state", str(limits / "usage"),
            "--limits", str(limits / "limits.map"), "--listen", f"127.0.0.1:{kind.usage}",
            # the records' queue the role's unit asks for (written by `prepare`); as root alone, as there
            *(["--records-queue", str(self.records_queue)] if self.records_queue and os.geteuid() == 0 else []),
            *(["--readers", str(self.usage_readers)] if self.usage_readers else [])],
            {}, kind.usage, pin_as="gateway", nice=self.usage_nice if os.geteuid() == 0 else 0)
        self.usage[kind.name] = self.procs[-1]
        self._start(kind.limits_dir, [haproxy_program(), "-W", "-db", *haproxy_args, "-f", str(limits / "haproxy.cfg")],
                    {"GATEWAY_KEY": GATEWAY_KEY}, kind.limits, pin_as="gateway")

    def __enter__(self):
        try:
            return self._start_all()
        except BaseException:
            # what did start stops: a proxy left behind keeps its port (SO_REUSEPORT), and the next
            # run's proxy would share it, answering with another run's certificates
            self.__exit__(None, None, None)
            raise

    def _start_all(self):
        env = {"VLLM_STANDIN_COLD_START": "0", "VLLM_STANDIN_ROUTES": str(ROUTES), "VLLM_API_KEY": VLLM_KEY,
               "PYTHONUNBUFFERED": "1"}
        if self.pace not in (None, NO_COST):
            env["VLLM_STANDIN_SECONDS_PER_STEP"] = str(self.pace)
        for i in range(self.replicas):
            port = PORTS["direct"] + i
            if self.pace == NO_COST:
                config = self.folder / f"no-cost-{i}.cfg"
                config.write_text(no_cost_config(port))
                self._start(f"vllm-{i}", [haproxy_program(), "-W", "-db", "-f", str(config)], {}, port)
            else:
                self._start(f"vllm-{i}", [sys.executable, "-c", STANDIN_LAUNCHER, str(STANDIN), "serve", MODEL,
                                          "--host", "127.0.0.1", "--port", str(port), "--served-model-name", MODEL],
                            env, port)
        self._start("frontdoor", [haproxy_program(), "-W", "-db", "-f", str(self.folder / "frontdoor" / "haproxy.cfg")],
                    {"VLLM_API_KEY": VLLM_KEY}, PORTS["frontdoor"])
        plan = json.loads((self.folder / "plan.json").read_text())
        for kind in KINDS.values():
            self._start_kind(kind, plan["kinds"][kind.name]["haproxy_args"])
        time.sleep(3)  # the gateway's and the front door's first health checks have passed
        return self

    def __exit__(self, *exc):
        for proc in self.procs:
            try:
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def wrk(folder: Path, url: str, concurrency: int, seconds: int, threads: int, script: str,
        cpus: set | None = None) -> dict:
    idle0, total0 = cpu_times()
    run = subprocess.run(["wrk", f"-t{min(threads, concurrency)}", f"-c{concurrency}", f"-d{seconds}s",
                          "--timeout", "30s", "-s", str(folder / script), url],
                         capture_output=True, text=True,
                         preexec_fn=(lambda: os.sched_setaffinity(0, cpus)) if cpus else None)
    idle1, total1 = cpu_times()
    found = [line for line in run.stdout.splitlines() if line.startswith("{")]
    if run.returncode != 0 or not found:
        raise SystemExit(f"wrk against {url} failed (exit {run.returncode}): {(run.stderr or run.stdout)[-1000:]}")
    out = json.loads(found[-1])
    out["cpu_idle"] = 100 * (idle1 - idle0) / max(total1 - total0, 1)
    return out


def proxy_timers(lines: list[str]) -> dict:
    """Where a proxy's time went for the requests of its logged ``lines`` (its access log's
    timers, whole ms): the p50 and p99 of *server* (Tr: from the request sent to the
    next hop until its answer's headers, the wait for the stand-in or the front door) and
    of *own* (Ta - Tr: everything else, HAProxy's own reading, queueing, connecting and
    sending)."""
    timers = haproxy_timers(lines)
    server, own = [tr for tr, _ in timers], [ta - tr for tr, ta in timers]
    out: dict = {"logged": len(timers)}
    for name, values in (("server", server), ("own", own)):
        for q in (50, 99):
            out[f"{name}_p{q}_ms"] = percentile(values, q / 100) if values else None
    return out


def paths() -> list[tuple[str, str, dict[str, str]]]:
    """Each path the bench loads: its name, its URL, and its proxies' logs in the bench folder (the
    front door's and the gateway's: a gateway with limits logs to its usage service alone, which
    writes each record's access part to its own output)."""
    out = [("direct", f"http://127.0.0.1:{PORTS['direct']}", {}),
           ("front door", f"https://127.0.0.1:{PORTS['frontdoor']}", {"frontdoor": "frontdoor"})]
    for kind in KINDS.values():
        out += [(kind.plain_path, f"https://127.0.0.1:{kind.plain}", {"frontdoor": "frontdoor", "gateway": kind.plain_dir}),
                (kind.limits_path, f"https://127.0.0.1:{kind.limits}",
                 {"frontdoor": "frontdoor", "gateway": f"{kind.name}-usage"})]
    return out


def run(folder: Path, seconds: int, levels: list[int], threads: int, rounds: int = 1,
        paces: dict | None = None, pin: bool = False) -> dict:
    """Every path at every concurrency, ``rounds`` times, the paths interleaved within a round
    (direct, front door, each kind of gateway without and with limits, then again), so the
    machine's drift falls on each alike."""
    if not haproxy_program():
        raise SystemExit("bench/gateway/loopback.py needs HAProxy: invoke lab.haproxy unpacks the 3.0 LTS the tests run "
                         "(or set DGEMMA_HAPROXY to one)")
    if not shutil.which("wrk"):
        raise SystemExit("bench/gateway/loopback.py needs wrk on PATH (Debian: apt-get install wrk)")
    plan = json.loads((folder / "plan.json").read_text())
    if set(plan.get("kinds", ())) != set(KINDS):
        raise SystemExit(f"{folder}: prepared by another version of the bench: run bench/gateway/loopback.py prepare again")
    rows = []
    pins = placement(plan["replicas"], os.cpu_count() or 1) if pin else None
    if pin and pins is None:
        raise SystemExit(f"--pin needs at least {plan['replicas'] + 6} cores")
    counts = []
    for pace_name, pace in (paces or PACES).items():
        with Processes(folder, pace, plan["replicas"], pins, plan.get("records_queue", 0),
                       plan.get("usage_nice", 0), plan.get("usage_readers", 0)):
            answered = dict.fromkeys(KINDS, 0)  # by each gateway with limits, warm-ups included: what its service must count
            for concurrency in levels:
                for number in range(1, rounds + 1):
                    for path, base, logs in paths():
                        url = f"{base}/v1/chat/completions"
                        script = "request-direct.lua" if path == "direct" else "request.lua"
                        cpus = (pins or {}).get("wrk")
                        warm = wrk(folder, url, min(concurrency, 4), 1, threads, script, cpus)  # connections and caches warm
                        offsets = {role: (folder / f"{log}.log").stat().st_size for role, log in logs.items()}
                        result = wrk(folder, url, concurrency, seconds, threads, script, cpus)
                        for kind in KINDS.values():
                            if path == kind.limits_path:
                                answered[kind.name] += warm["requests"] + result["requests"]
                        logged = {role: logged_since(folder / f"{log}.log", offsets[role]) for role, log in logs.items()}
                        timers = {role: proxy_timers(lines) for role, lines in logged.items()}
                        # what went wrong, as the path's first proxy logged it
                        first = "gateway" if "gateway" in logs else "frontdoor" if logs else None
                        failed = failed_by_state(logged[first]) if first else {}
                        rows.append({"pace": pace_name, "path": path, "concurrency": concurrency, "round": number,
                                     **result, "haproxy": timers, "failed_by_state": failed})
                        print(f"{pace_name:>9} {path:>37} c={concurrency:<3} round {number}: "
                              f"{result['requests'] / (result['duration_us'] / 1e6):8.0f} req/s p50 "
                              f"{result['p50_us'] / 1000:7.2f} ms p99 {result['p99_us'] / 1000:7.2f} ms "
                              f"errors {result['errors']}{' ' + json.dumps(failed) if failed else ''} "
                              f"idle {result['cpu_idle']:.0f}%", flush=True)
            time.sleep(2)  # the last records reach the usage services
            time.sleep(1.5)  # the services have read HAProxy's count of records it dropped (every 0.5 s)
            for kind in KINDS.values():
                (counted, lost, read), taken = usage_counts(kind), requests_taken(kind)
                counts.append({"pace": pace_name, "kind": kind.name, "answered": answered[kind.name], "counted": counted,
                               "lost": lost, "taken": taken, "read": read})
                print(f"{pace_name:>9} the {kind.name} gateway with limits answered {answered[kind.name]} requests "
                      f"(wrk), took {taken} (its HAProxy), its usage service counted {counted}, read {read} lines, "
                      f"lost {lost}", flush=True)
    return {"counts": counts, "machine": platform.node(), "cores": os.cpu_count(), "cpu": _cpu_name(), "seconds": seconds,
            "rounds": rounds, "replicas": plan["replicas"], "haproxy": _version([haproxy_program(), "-v"]), "rows": rows,
            "kinds": {k.name: {"host": k.host, "threads": _threads(folder / k.limits_dir / "haproxy.cfg")}
                      for k in KINDS.values()},
            "pinned": {k: sorted(v) for k, v in pins.items()} if pins else None}


def _threads(config: Path) -> str:
    """The threads a gateway's configuration keeps to (nbthread), or HAProxy's own choice."""
    found = re.search(r"^\s*nbthread (\d+)", config.read_text(), re.M)
    return found.group(1) if found else "every core"


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "?"


def _version(args: list[str]) -> str:
    try:
        return subprocess.run(args, capture_output=True, text=True).stdout.splitlines()[0]
    except (OSError, IndexError):
        return "?"


def _states(runs: list[dict]) -> str:
    """The failed requests of ``runs`` by HAProxy's termination state and status, summed."""
    total: dict[str, int] = {}
    for r in runs:
        for state, n in (r.get("failed_by_state") or {}).items():
            total[state] = total.get(state, 0) + n
    return ", ".join(f"{n} {state}" for state, n in sorted(total.items())) or "-"


def table(result: dict) -> str:
    """A row per pace, path and concurrency: the median over the rounds of each figure, and of
    each round's difference from that round's direct call (*added*)."""
    rows = result["rows"]
    direct = {(r["pace"], r["concurrency"], r.get("round", 1)): r for r in rows if r["path"] == "direct"}
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["pace"], r["path"], r["concurrency"]), []).append(r)
    lines = ["| pace | path | c | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | errors | failed, by termination "
             "state | CPU idle % |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for (pace, path, concurrency), runs in groups.items():
        def median(key):
            return _median([key(r) for r in runs])
        base = [direct.get((pace, concurrency, r.get("round", 1))) for r in runs]
        if path == "direct" or None in base:
            added = ("-", "-")
        else:
            added = tuple(f"{_median([(r[k] - b[k]) / 1000 for r, b in zip(runs, base)]):+.2f}"
                          for k in ("p50_us", "p99_us"))
        lines.append(f"| {pace} | {path} | {concurrency} | {median(lambda r: r['requests'] / (r['duration_us'] / 1e6)):.0f} "
                     f"| {median(lambda r: r['p50_us']) / 1000:.2f} | {median(lambda r: r['p99_us']) / 1000:.2f} | "
                     f"{added[0]} | {added[1]} | {sum(r['errors'] for r in runs)} | {_states(runs)} | "
                     f"{median(lambda r: r['cpu_idle']):.0f} |")
    return "\n".join(lines)


def limits_table(result: dict) -> str:
    """What each key's limits and counting add to each kind of gateway: the path with them minus
    the same gateway without, round by round (medians), the share of its requests a second the
    gateway keeps, and whether its usage service counted every request it took."""
    rows = result["rows"]
    by_round = {(r["pace"], r["path"], r["concurrency"], r.get("round", 1)): r for r in rows}
    groups: dict = {}
    for kind in KINDS.values():
        for r in rows:
            if r["path"] == kind.limits_path:
                plain = by_round.get((r["pace"], kind.plain_path, r["concurrency"], r.get("round", 1)))
                if plain:
                    groups.setdefault((r["pace"], kind.name, r["concurrency"]), []).append((r, plain))
    if not groups:
        return ""
    kinds = result.get("kinds", {})
    lines = ["| pace | gateway | c | req/s without | req/s with | kept | added p50 ms | added p99 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (pace, name, concurrency), pairs in groups.items():
        rate = lambda r: r["requests"] / (r["duration_us"] / 1e6)  # noqa: E731
        without, with_ = _median([rate(b) for _, b in pairs]), _median([rate(r) for r, _ in pairs])
        threads = kinds.get(name, {}).get("threads")
        lines.append(f"| {pace} | {name} ({KINDS[name].host}{', threads: ' + threads if threads else ''}) | "
                     f"{concurrency} | {without:.0f} | {with_:.0f} | {100 * with_ / without:.1f}% | "
                     f"{_median([(r['p50_us'] - b['p50_us']) / 1000 for r, b in pairs]):+.3f} | "
                     f"{_median([(r['p99_us'] - b['p99_us']) / 1000 for r, b in pairs]):+.3f} |")
    for count in result.get("counts", []):
        lost, taken, who = count.get("lost"), count.get("taken"), count.get("kind", "dedicated")
        if taken:
            # HAProxy's own count: every request it took is logged, so a record sent (or dropped)
            missed = taken - count["counted"] - (lost or 0)
            lines.append(f"\n{count['pace']}, the {who} gateway: with limits it took {taken} requests (its HAProxy's "
                         f"count, warm-ups included; wrk's answered {count['answered']}); its usage service counted "
                         f"{count['counted']} ({100 * count['counted'] / taken:.2f}%)"
                         + (f"; it read {count['read']} lines of HAProxy's in all" if count.get("read") else "")
                         + (f"; HAProxy dropped {lost} lines (a full socket queue), which the service counts as "
                            f"lost (dgemma_usage_records_lost_total)" if lost else "")
                         + (f"; {missed} neither counted nor counted lost" if missed > 0 else "") + ".")
    return "\n".join(lines)


def profile_table(result: dict) -> str:
    """Where each path's p99 goes, from the proxies' own logs (medians over the rounds):
    waiting for the next hop (Tr) against each proxy's own time (Ta - Tr); HAProxy logs
    whole milliseconds."""
    groups: dict = {}
    for r in result["rows"]:
        if r.get("haproxy"):
            groups.setdefault((r["pace"], r["path"], r["concurrency"]), []).append(r)
    if not groups:
        return ""
    lines = ["| pace | path | c | p99 ms (wrk) | front door: waiting for the replica p99 ms | front door: own p99 ms "
             "| gateway: waiting for the front door p99 ms | gateway: own p99 ms |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for (pace, path, concurrency), runs in groups.items():
        def timer(proxy, key):
            values = [r["haproxy"][proxy][key] for r in runs if proxy in r["haproxy"] and
                      r["haproxy"][proxy][key] is not None]
            return f"{_median(values):.0f}" if values else "-"
        lines.append(f"| {pace} | {path} | {concurrency} | {_median([r['p99_us'] for r in runs]) / 1000:.2f} | "
                     f"{timer('frontdoor', 'server_p99_ms')} | {timer('frontdoor', 'own_p99_ms')} | "
                     f"{timer('gateway', 'server_p99_ms')} | {timer('gateway', 'own_p99_ms')} |")
    return "\n".join(lines)


def write(results: list[dict]):
    from bench.toolkit import write_section
    parts = [f"{MARK_BEGIN}\n## The front door and the gateway on loopback, where cores are spare\n\n"
             f"`python3 bench/gateway/loopback.py` ({time.strftime('%Y-%m-%d')}): the vLLM stand-in, the front "
             f"door's and the gateways' HAProxy as plain processes on loopback, with the configurations deploy "
             f"renders (TLS, allowlist, key check by sha256, retries, access log to a file), loaded by wrk "
             f"(non-streaming chat completions of 16 tokens, kept-alive connections, each sending its next request "
             f"when the last is answered). *realistic*: the stand-in's own pace (~96 ms an answer: one canvas); "
             f"*at once*: time per step 0, so the rows show what each layer holds at saturation (the stand-in, one "
             f"Python event loop, is then the limit of the direct row); *no cost*: in the stand-in's place an HAProxy "
             f"that answers a fixed completion with its usage at once, so that only the proxies cost anything and "
             f"their own saturation shows (the usage service is started as its unit starts it: records queue 4096, "
             f"niceness -10, 4 reader processes). "
             f"*Added* is the path minus the direct call at "
             f"the same pace and concurrency; *CPU idle* is the whole machine's during the row. Runs with `--pin` put "
             f"each part on CPUs of its own. Where a run has them, the proxies' access-log timers say where the "
             f"p99 goes: waiting for the next hop (HAProxy's Tr) or the proxy's own work (Ta - Tr, whole ms). "
             f"At concurrency 64 the stand-in's own p99 moves by several ms from round to round (an asyncio "
             f"timer per request, one event loop), and the added p99 moves with it; the proxies' own p99 is the "
             f"figure that belongs to them. Two kinds of gateway, each rendered by the gateway role for a host of "
             f"its own fleet (bench/gateway/fleets, read as deploy reads an inventory; tests/test_bench_gateway_render.py "
             f"holds each to the role's render line for line): *dedicated*, a host in the group `gateway` alone "
             f"(HAProxy takes every core), as the built-in lab's gateways; *serving*, a host that serves too, its "
             f"gateway kept to the threads set apart for it (`gateway_threads`, 2 by default), as the small and "
             f"two-machine labs' gateways. Each runs with its limits, as deploy renders it, and without (the "
             f"reference its cost is measured against). *Failed, by termination state*: each request the path's first "
             f"proxy did not answer 2xx, by HAProxy's termination state and status (`SC-- 503`: no server to send "
             f"it to)."]
    for result in results:
        pinned = result.get("pinned")
        placed = ("; each part on CPUs of its own (" + ", ".join(f"{k} {v[0]}-{v[-1]}" if len(v) > 1 else f"{k} {v[0]}"
                                                               for k, v in pinned.items()) + ")") if pinned else ""
        profile = profile_table(result)
        limited = limits_table(result)
        parts.append(f"\n\n### {result['cores']} cores: {result['cpu']} ({result['machine']}){', pinned' if pinned else ''}\n\n"
                     f"{result['haproxy']}; {result['seconds']} s per row, {result.get('rounds', 1)} round(s) "
                     f"interleaved (medians); {result['replicas']} stand-in replica(s) behind the front "
                     f"door{placed}.\n\n{table(result)}\n" +
                     (f"\nWhere the p99 goes, from the proxies' access logs:\n\n{profile}\n" if profile else "") +
                     (f"\nWhat each key's limits and counting add to each kind of gateway (the same gateway with "
                      f"them, minus without; *kept*: its requests a second with them, of without; the bench key has "
                      f"every limit, none reached):\n\n{limited}\n" if limited else ""))
    write_section(MARK_BEGIN, MARK_END, "".join(parts) + f"\n{MARK_END}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("step", nargs="?", choices=("prepare", "run"), help="one step alone (default: both)")
    parser.add_argument("folder", nargs="?", help="where the configurations live (default: a new one)")
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument("--concurrency", default="1,64,256")
    parser.add_argument("--threads", type=int, default=1, help="wrk's threads (at most one per connection)")
    parser.add_argument("--rounds", type=int, default=1, help="each row this many times, interleaved (medians)")
    parser.add_argument("--replicas", type=int, default=1, help="stand-in replicas behind the front door")
    parser.add_argument("--pin", action="store_true",
                        help="each part on CPUs of its own (a core per stand-in replica, a quarter of the rest per "
                             "proxy, the rest for wrk): shows what sharing cores costs")
    parser.add_argument("--paces", default=",".join(PACES), help="which paces: realistic, at once, no cost (comma-separated)")
    parser.add_argument("--json", help="write the figures as JSON to this file")
    parser.add_argument("--results", help="with --write: JSON files of earlier runs (another machine's), comma-separated")
    parser.add_argument("--write", action="store_true", help="put the table(s) into docs/PERFORMANCE.md")
    parser.add_argument("--no-run", action="store_true",
                        help="with --write and --results: write those runs' tables alone (a run made on another machine)")
    args = parser.parse_args()
    if args.no_run:
        if not (args.write and args.results):
            raise SystemExit("--no-run writes the runs --results names: give both --write and --results")
        write([json.loads(Path(p).read_text()) for p in args.results.split(",")])
        return
    import tempfile
    folder = Path(args.folder or tempfile.mkdtemp(prefix="bench-loopback-"))
    if args.step in (None, "prepare"):
        prepare(folder, args.replicas)
        if args.step == "prepare":
            print(folder)
            return
    paces = {name: PACES[name] for name in args.paces.split(",") if name in PACES}
    if not paces:
        raise SystemExit(f"--paces: choose among {', '.join(PACES)}")
    result = run(folder, args.seconds, [int(c) for c in args.concurrency.split(",")], args.threads, args.rounds,
                 paces, args.pin)
    print(table(result))
    print(limits_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    if args.write:
        earlier = [json.loads(Path(p).read_text()) for p in (args.results or "").split(",") if p]
        write(earlier + [result])
    if any(r["errors"] for r in result["rows"]):
        raise SystemExit("some requests failed: see the errors column")


if __name__ == "__main__":
    main()
