"""`invoke top`: the fleet as it is now, per host and replica: requests running and
waiting, tokens per second, time to first token (p50, p95), KV cache, GPU utilization and
memory, errors, a diffusion model's denoising steps per committed token and canvas fill
(what its entropy bound does), each host's state in the gateways; and the alerts that fire.

Two sources, the same snapshot:
- Prometheus on a monitoring host, asked over SSH (curl on its loopback: it listens
  nowhere else), each query at one instant, so that `--json` agrees with Prometheus;
- without one, each host itself (its replicas' /metrics on loopback, its front door's and
  the gateways' stats pages, the GPU collector's textfile), rates and percentiles from
  the difference between two readings. No alert is evaluated then.
"""
from __future__ import annotations

import base64
import json
import threading
import time
from dataclasses import asdict, dataclass, field

from serving.fleet import is_gateway, is_monitoring, is_serving
from serving.haproxy.stats import POOL_PREFIX
from serving.host_programs import Program, ProgramResultError, Protocol, decoded
from serving.replicas import server_index

from . import exposition
from .readings import (PROGRAMS, HostReading, denoising_ratios, firing, gateway_script, host_script, parse_stats_csv,
                       read_gateway, read_host)


@dataclass
class ReplicaLoad:
    host: str
    replica: int
    model: str = ""
    up: bool | None = None
    running: float | None = None
    waiting: float | None = None
    tokens_s: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    kv_cache: float | None = None  # 0..1
    gpu_util: float | None = None  # percent, the mean of its GPUs
    gpu_memory_used_mib: float | None = None
    gpu_memory_total_mib: float | None = None
    errors_s: float | None = None  # 5xx answers per second through the front door
    gpus: list = field(default_factory=list)
    # a diffusion model's, over the window: denoising steps per committed token, committed tokens
    # over canvas positions (None: nothing committed in the window, or not a diffusion model)
    steps_per_token: float | None = None
    canvas_fill: float | None = None


@dataclass
class KeyLoad:
    """A key (or a front end's user) through the gateways: requests and tokens per second now,
    tokens charged today."""
    key: str
    user: str = ""
    requests_s: float | None = None
    tokens_s: float | None = None
    tokens_today: float | None = None


BUSIEST = 5  # keys shown, busiest first


def busiest(keys: dict) -> list:
    return sorted(keys.values(), key=lambda k: (-(k.requests_s or 0), -(k.tokens_today or 0), k.key, k.user))[:BUSIEST]


@dataclass
class Snapshot:
    source: str
    at: float  # the instant the figures are for (Prometheus's evaluation time)
    replicas: list = field(default_factory=list)
    gateway: dict = field(default_factory=dict)  # serving host -> its state in the gateways (worst seen)
    alerts: list = field(default_factory=list)  # firing: alertname, severity, host, replica, summary, fix
    alerts_known: bool = True  # False: no Prometheus, no rule evaluated
    problems: list = field(default_factory=list)
    keys: list = field(default_factory=list)  # KeyLoad, the busiest first

    def as_dict(self) -> dict:
        return {"source": self.source, "at": self.at, "replicas": [asdict(r) for r in self.replicas],
                "gateway": self.gateway, "alerts": self.alerts if self.alerts_known else None,
                "problems": self.problems, "keys": [asdict(k) for k in self.keys]}


# the worst state a host has in any gateway's pool first (HAProxy's NOLB: drained by a roll)
STATE_ORDER = ["DOWN", "MAINT", "DRAIN", "NOLB", "UP"]


def worst(states) -> str:
    states = [s.split()[0] if s else "?" for s in states]
    known = [s for s in states if s in STATE_ORDER]
    state = min(known, key=STATE_ORDER.index) if known else (states[0] if states else "-")
    return "DRAIN" if state == "NOLB" else state


# ---------------------------------------------------------------- Prometheus

QUERIES = {
    "up": 'up{job="vllm"}',
    "running": "vllm:num_requests_running",
    "waiting": "vllm:num_requests_waiting",
    "tokens": "sum by (host, replica) (rate(vllm:generation_tokens_total[1m]))",
    "ttft50": "histogram_quantile(0.5, sum by (host, replica, le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))",
    "ttft95": "histogram_quantile(0.95, sum by (host, replica, le) (rate(vllm:time_to_first_token_seconds_bucket[1m])))",
    "kv": "vllm:kv_cache_usage_perc",
    "errors": 'sum by (host, server) (rate(haproxy_server_http_responses_total{job="frontdoor", '
              'proxy=~"servers|pool_.+", code="5xx"}[1m]))',
    # a diffusion model's counters (vllm/v1/spec_decode/metrics.py): their rates, the ratios here
    "denoising_steps": "sum by (host, replica) (rate(vllm:diffusion_num_denoising_steps_total[1m]))",
    "canvas_positions": "sum by (host, replica) (rate(vllm:diffusion_num_canvas_positions_total[1m]))",
    "committed_tokens": "sum by (host, replica) (rate(vllm:diffusion_num_committed_tokens_total[1m]))",
    "gpu_util": "DCGM_FI_DEV_GPU_UTIL",
    "gpu_used": "DCGM_FI_DEV_FB_USED",
    "gpu_free": "DCGM_FI_DEV_FB_FREE",
    "gateway": 'haproxy_server_status{job="gateway", proxy=~"pool_.+"} == 1',
    # the keys, summed over the gateways (each counts what it served)
    "key_requests": "sum by (key, user) (rate(dgemma_usage_requests_total[1m]))",
    "key_tokens": "sum by (key, user) (rate(dgemma_usage_prompt_tokens_total[1m]) "
                  "+ rate(dgemma_usage_completion_tokens_total[1m]))",
    "key_today": "max by (key, user) (dgemma_key_tokens_today)",
}


PROMETHEUS = Protocol("Prometheus's answers", result={"answers": "each query's name -> its answer (base64)",
                                                      "alerts": "the alerts it evaluates (base64)"})
PROMETHEUS_PROGRAM = Program((PROGRAMS / "prometheus.sh",), PROMETHEUS)


def prometheus_script(port: int, at: float) -> str:
    """Every query at the instant ``at``, then the alerts (day2/host_programs/prometheus.sh)."""
    queries = "\n".join(f"{name} {base64.b64encode(query.encode()).decode()}" for name, query in QUERIES.items())
    return PROMETHEUS_PROGRAM.script({"URL": f"http://127.0.0.1:{int(port)}", "AT": f"{at:.3f}", "QUERIES": queries})


def parse_sections(output: str) -> dict[str, str]:
    """Each query's answer by its name, and the alerts' (``alerts``); none when Prometheus's
    host gave no result."""
    try:
        found = PROMETHEUS.result_of(output)
    except ProgramResultError:
        return {}
    sections = {name: decoded(text, f"the answer to {name}") for name, text in (found["answers"] or {}).items()}
    sections["alerts"] = decoded(found["alerts"], "the alerts")
    return sections


def _vector(text: str) -> list[tuple[dict, float]]:
    try:
        data = json.loads(text)
    except ValueError:
        return []
    if data.get("status") != "success":
        return []
    out = []
    for item in data["data"].get("result") or []:
        try:
            out.append((item["metric"], float(item["value"][1])))
        except (KeyError, TypeError, ValueError):
            continue
    return out


def snapshot_from_prometheus(output: str, at: float, source: str) -> Snapshot:
    """The snapshot the answers of `prometheus_script` make."""
    sections = parse_sections(output)
    vectors = {name: _vector(sections.get(name, "")) for name in QUERIES}
    snap = Snapshot(source, at)
    rows: dict[tuple[str, int], ReplicaLoad] = {}
    for labels, v in vectors["up"]:
        if not str(labels.get("replica", "")).isdigit():
            continue
        key = (labels.get("host", "?"), int(labels["replica"]))
        rows[key] = ReplicaLoad(key[0], key[1], labels.get("model", ""), up=v == 1,
                                gpus=[u for u in labels.get("gpu_uuid", "").split(",") if u])

    def put(name, attr, scale=1.0):
        for labels, v in vectors[name]:
            row = rows.get((labels.get("host"), int(labels["replica"]))) if str(labels.get("replica", "")).isdigit() \
                else None
            if row is not None and v == v:  # NaN: no observation in the window
                setattr(row, attr, v * scale)

    put("running", "running")
    put("waiting", "waiting")
    put("tokens", "tokens_s")
    put("ttft50", "ttft_p50_s")
    put("ttft95", "ttft_p95_s")
    put("kv", "kv_cache")
    work: dict = {}
    for name in ("denoising_steps", "canvas_positions", "committed_tokens"):
        for labels, v in vectors[name]:
            if str(labels.get("replica", "")).isdigit() and v == v:
                work.setdefault((labels.get("host"), int(labels["replica"])), {})[name] = v
    for key, rates in work.items():
        if key in rows:
            _denoising(rows[key], rates)
    for labels, v in vectors["errors"]:
        index = server_index(labels.get("server", ""))
        if index is not None:
            row = rows.get((labels.get("host"), index))
            if row is not None:
                row.errors_s = (row.errors_s or 0.0) + v
    gpu = {}
    for name in ("gpu_util", "gpu_used", "gpu_free"):
        for labels, v in vectors[name]:
            uuid = labels.get("gpu_uuid") or labels.get("UUID")
            gpu.setdefault((labels.get("host"), uuid), {})[name] = v
    for row in rows.values():
        _gpu_figures(row, [gpu.get((row.host, u), {}) for u in row.gpus])
    states: dict[str, list[str]] = {}
    for labels, _ in vectors["gateway"]:
        states.setdefault(labels.get("server", "?"), []).append(labels.get("state", "?"))
    snap.gateway = {host: worst(s) for host, s in states.items()}
    snap.replicas = sorted(rows.values(), key=lambda r: (r.host, r.replica))
    keys: dict = {}
    for name, attr in (("key_requests", "requests_s"), ("key_tokens", "tokens_s"), ("key_today", "tokens_today")):
        for labels, v in vectors[name]:
            who = (labels.get("key", "?"), labels.get("user", ""))
            if v == v:
                setattr(keys.setdefault(who, KeyLoad(*who)), attr, v)
    snap.keys = busiest(keys)
    try:
        alerts = json.loads(sections.get("alerts", "") or "{}").get("data", {}).get("alerts", [])
    except ValueError:
        alerts, snap.problems = [], snap.problems + ["Prometheus's alerts did not answer"]
    snap.alerts = [firing(a, since="activeAt") for a in alerts if a.get("state") == "firing"]
    if not sections:
        snap.problems.append("Prometheus did not answer")
    return snap


def _denoising(row: ReplicaLoad, work: dict):
    """Steps per committed token and canvas fill from a window's counts (or rates) of the three."""
    ratios = denoising_ratios(work.get("denoising_steps", 0), work.get("canvas_positions", 0),
                              work.get("committed_tokens", 0))
    row.steps_per_token, row.canvas_fill = ratios["steps_per_committed_token"], ratios["canvas_fill"]


DENOISING_COUNTERS = {"denoising_steps": "vllm:diffusion_num_denoising_steps_total",
                      "canvas_positions": "vllm:diffusion_num_canvas_positions_total",
                      "committed_tokens": "vllm:diffusion_num_committed_tokens_total"}


def _gpu_figures(row: ReplicaLoad, figures: list[dict]):
    utils = [f["gpu_util"] for f in figures if "gpu_util" in f]
    if utils:
        row.gpu_util = sum(utils) / len(utils)
    used = [f["gpu_used"] for f in figures if "gpu_used" in f]
    totals = [f["gpu_used"] + f["gpu_free"] for f in figures if "gpu_used" in f and "gpu_free" in f]
    if used:
        row.gpu_memory_used_mib = sum(used)
    if totals:
        row.gpu_memory_total_mib = sum(totals)


class PrometheusSource:
    """Prometheus on ``host`` (a monitoring host), over the run's connection to it."""

    def __init__(self, connections, host: str, hostvars: dict):
        self.connections, self.host = connections, host
        self.port = int(hostvars.get("prometheus_port", 9090))
        self.name = f"Prometheus on {host}"

    def snapshot(self) -> Snapshot:
        at = time.time()
        result = self.connections.get(self.host).run(prometheus_script(self.port, at), timeout=30)
        snap = snapshot_from_prometheus(result.stdout, at, self.name)
        if result.rc != 0 and not snap.replicas:
            snap.problems.append(f"{self.host}: {result.stderr.strip()[-200:] or 'the queries failed'}")
        return snap


# ---------------------------------------------------------------- the hosts themselves

def loads_from_readings(host: str, now: HostReading, before: HostReading | None) -> list[ReplicaLoad]:
    """The host's replicas from two readings (rates and percentiles over the time between)."""
    out = []
    span = (now.at - before.at) if before else 0.0
    gpus = {}
    for name, labels, v in now.gpu:
        gpus.setdefault(labels.get("UUID"), {})[{"DCGM_FI_DEV_GPU_UTIL": "gpu_util", "DCGM_FI_DEV_FB_USED": "gpu_used",
                                                 "DCGM_FI_DEV_FB_FREE": "gpu_free"}.get(name, name)] = v
    for index, (group, samples) in sorted(now.replicas.items()):
        row = ReplicaLoad(host, index, group.get("family", ""), up=bool(samples), gpus=list(group.get("gpus") or []))
        if samples:
            row.running = exposition.value(samples, "vllm:num_requests_running")
            row.waiting = exposition.value(samples, "vllm:num_requests_waiting")
            row.kv_cache = exposition.value(samples, "vllm:kv_cache_usage_perc")
        old = before.replicas.get(index, (None, []))[1] if before else []
        if samples and old and span > 0:
            tokens_now = exposition.value(samples, "vllm:generation_tokens_total") or 0.0
            tokens_then = exposition.value(old, "vllm:generation_tokens_total") or 0.0
            row.tokens_s = max(tokens_now - tokens_then, 0.0) / span if tokens_now >= tokens_then else tokens_now / span
            window = exposition.delta(exposition.buckets(samples, "vllm:time_to_first_token_seconds"),
                                      exposition.buckets(old, "vllm:time_to_first_token_seconds"))
            row.ttft_p50_s = exposition.histogram_quantile(0.5, window)
            row.ttft_p95_s = exposition.histogram_quantile(0.95, window)
            grown = {name: (exposition.value(samples, metric) or 0.0) - (exposition.value(old, metric) or 0.0)
                     for name, metric in DENOISING_COUNTERS.items()}
            if all(v >= 0 for v in grown.values()):  # a restart between the readings: no window
                _denoising(row, grown)
        if before and span > 0:
            errors_now = _server_5xx(now.frontdoor, index)
            errors_then = _server_5xx(before.frontdoor, index)
            if errors_now is not None and errors_then is not None:
                row.errors_s = max(errors_now - errors_then, 0.0) / span
        _gpu_figures(row, [gpus.get(u, {}) for u in row.gpus])
        out.append(row)
    return out


def _server_5xx(rows: list[dict], index: int) -> float | None:
    """5xx answers of replica ``index`` so far (every backend it serves in: servers, its pool)."""
    found = [float(r.get("hrsp_5xx") or 0) for r in rows if server_index(r.get("svname")) == index
             and (r.get("pxname") == "servers" or r.get("pxname", "").startswith(POOL_PREFIX))]
    return sum(found) if found else None


class HostsSource:
    """The serving hosts and the gateways themselves, over one connection each."""

    def __init__(self, connections, hostvars_by_name: dict[str, dict]):
        self.connections = connections
        self.serving = {h: v for h, v in hostvars_by_name.items() if is_serving(v)}
        self.gateways = [h for h, v in hostvars_by_name.items() if is_gateway(v)]
        self.before: dict[str, HostReading] = {}
        self.usage_before: dict[str, tuple[float, list]] = {}  # gateway -> (when, its usage service's samples)
        self.name = "the hosts themselves (no Prometheus: no alert is evaluated)"

    def snapshot(self) -> Snapshot:
        at = time.time()
        outputs, problems = {}, []

        def one(host, script):
            try:
                result = self.connections.get(host).run(script, timeout=30)
                outputs[host] = result.stdout
            except Exception as exc:  # noqa: BLE001 - one host's failure is a line of the view, not the end of it
                problems.append(f"{host}: {str(exc)[:200]}")

        threads = [threading.Thread(target=one, args=(h, host_script(v))) for h, v in self.serving.items()]
        threads += [threading.Thread(target=one, args=(h, gateway_script())) for h in self.gateways]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        snap = Snapshot(self.name, at, alerts_known=False, problems=sorted(problems))
        for host in self.serving:
            if host not in outputs:
                continue
            reading = read_host(outputs[host], at, self.serving[host])
            snap.replicas += loads_from_readings(host, reading, self.before.get(host))
            self.before[host] = reading
        states: dict[str, list[str]] = {}
        for host in self.gateways:
            for server in parse_stats_csv(read_gateway(outputs.get(host, ""))["stats"]):
                states.setdefault(server["server"], []).append(server["state"])
        snap.gateway = {h: worst(s) for h, s in states.items()}
        snap.replicas.sort(key=lambda r: (r.host, r.replica))
        keys: dict = {}
        for host in self.gateways:
            samples = exposition.parse(read_gateway(outputs.get(host, ""))["usage"])
            before = self.usage_before.get(host)
            self.usage_before[host] = (at, samples)
            keys_from_usage(keys, samples, before, at)
        snap.keys = busiest(keys)
        return snap


USAGE_COUNTS = {"requests_s": ("dgemma_usage_requests_total",),
                "tokens_s": ("dgemma_usage_prompt_tokens_total", "dgemma_usage_completion_tokens_total")}


def keys_from_usage(keys: dict, samples: list, before: tuple | None, at: float):
    """One gateway's usage service's counts into ``keys`` ((key, user) -> KeyLoad): its tokens of
    today (the highest a gateway holds), and with an earlier reading, its rates (summed)."""
    def total(readings, names, who):
        return sum(v for name, labels, v in readings
                   if name in names and (labels.get("key"), labels.get("user", "")) == who)
    for name, labels, v in samples:
        who = (labels.get("key", "?"), labels.get("user", ""))
        row = keys.setdefault(who, KeyLoad(*who))
        if name == "dgemma_key_tokens_today":
            row.tokens_today = max(row.tokens_today or 0, v)
    if before is None or at <= before[0]:
        return
    for who, row in keys.items():
        for attr, names in USAGE_COUNTS.items():
            grew = total(samples, names, who) - total(before[1], names, who)
            setattr(row, attr, (getattr(row, attr) or 0) + max(grew, 0) / (at - before[0]))


def monitoring_host(hostvars_by_name: dict[str, dict]) -> str | None:
    return next((h for h, v in hostvars_by_name.items() if is_monitoring(v)), None)
