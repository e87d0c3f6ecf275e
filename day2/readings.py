"""Reading the fleet from its hosts: what `invoke status` and `invoke top` ask each host,
and how each answer reads. A serving host's replicas (their container, /health, load and
the command line in force; their /metrics), its front door's stats page and the GPU
collector's textfile; a gateway's servers; the alerts that fire. Both commands read the
fleet through this module alone."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from converge.facts import Fact, FactError

from serving import scrape_targets
from serving.exporter_containers import TEXTFILES
from serving.accounting import USAGE_PORT
from serving.haproxy.instance import FRONTDOOR, GATEWAY
from serving.haproxy.stats import POOL_PREFIX, server_rows, stats_rows
from serving.host_programs import Program, ProgramResultError, Protocol, decoded
from serving.replicas import from_unit, replica, runtime, unit_globs
from serving.vllm_serve import diffusion_in_force, generation_in_force

from . import exposition

PROGRAMS = Path(__file__).parent / "host_programs"  # what these readings run on the hosts


# ---------------------------------------------------------------- a serving host's replicas

def replica_units(v: dict) -> dict:
    """Where a program finds the host's replica units (day2/host_programs/units.sh)."""
    return {"UNIT_GLOBS": " ".join(unit_globs(v)), "FIRST_UNIT": replica(v, 0).unit}


def by_replica(v: dict, units: dict) -> dict:
    """What a program said of each replica unit (unit -> what), by the replica's index: which
    replica a unit is, is read here (serving/replicas.py); a unit of none is left out."""
    found = {}
    for unit, what in (units or {}).items():
        ident = from_unit(v, unit)
        if ident is not None:
            found[ident.index] = (ident, what)
    return found


def pages_script(program: Program, pages: dict) -> str:
    """files/pages.sh asking each page (name -> (seconds it may take, URL)) on the host itself."""
    return program.script({"PAGES": "\n".join(f"{name} {int(seconds)} {url}" for name, (seconds, url) in pages.items())})


def read_pages(protocol: Protocol, output: str) -> dict:
    """Each page `pages_script` asked: name -> (its text, None), or ("", why it did not answer)."""
    found = protocol.result_of(output)
    pages = {}
    for name, page in found.items():
        body = decoded(page.get("body", "") if isinstance(page, dict) else "", f"the page {name}")
        rc = page.get("rc") if isinstance(page, dict) else None
        pages[name] = (body, None) if rc == 0 else ("", body.strip()[-200:] or f"curl exit {rc}")
    return pages


REPLICAS = Protocol("the replicas' containers, processes, health and load", result={
    "containers": "the runtime's containers: NAME STATE lines (base64)",
    "units": "each replica unit -> its argv (base64), /health's status and load"})
REPLICAS_PROGRAM = Program((PROGRAMS / "units.sh", PROGRAMS / "replicas.sh"), REPLICAS)


class ServiceProbe(Fact):
    """Each replica's container state, /health and load (requests running and waiting, KV
    cache, from its /metrics), from the host itself: replica index -> {"container",
    "health", "load", "diffusion", "generation"}, for every replica unit the host has (replica
    0 when none). The host says what runs (its containers by name, each unit's command line);
    which replica a unit or a container is, is read here (serving/replicas.py)."""

    def __init__(self, v):
        self.v = v
        self.command = REPLICAS_PROGRAM.script({"RUNTIME": runtime(v), **replica_units(v)})

    def process(self, output, rc):
        try:
            result = REPLICAS.result_of(output)
        except ProgramResultError as exc:
            raise FactError(f"the replicas could not be read: {exc}") from None
        containers = {}
        for line in decoded(result["containers"], "the containers").splitlines():
            name, _, state = line.partition(" ")
            containers[name.lstrip("/")] = state.strip() or "?"
        found = {}
        for index, (ident, seen) in by_replica(self.v, result["units"]).items():
            if not isinstance(seen, dict):
                continue
            # the command line it runs (empty: no process), its NUL-separated words
            argv = decoded(seen.get("argv", ""), f"{ident.unit}'s command line").split("\0") if seen.get("argv") else []
            found[index] = {"container": containers.get(ident.container, "absent"),
                            "health": seen.get("health") or "", "load": parse_load(seen.get("load") or ""),
                            "denoising": parse_denoising(seen.get("denoising") or ""),
                            "diffusion": diffusion_in_force(argv), "generation": generation_in_force(argv)}
        return found


def parse_load(text: str) -> dict | None:
    """``running,waiting,kv`` as the probe prints it; None when vLLM's /metrics did not answer."""
    parts = text.split(",")
    if len(parts) != 3:
        return None
    try:
        running, waiting, kv = (float(p) for p in parts)
    except ValueError:
        return None
    return {"running": int(running), "waiting": int(waiting), "kv_cache_usage": round(kv, 4)}


def parse_denoising(text: str) -> dict | None:
    """``steps,positions,committed`` as the probe prints them (a diffusion model's counters since
    it started), with their ratios; None for a model that exports none."""
    parts = text.split(",")
    if len(parts) != 3 or not all(p.isdigit() for p in parts):
        return None
    steps, positions, committed = (int(p) for p in parts)
    return {"denoising_steps": steps, "canvas_positions": positions, "committed_tokens": committed,
            **denoising_ratios(steps, positions, committed)}


def denoising_ratios(steps: float, positions: float, committed: float) -> dict:
    """What the entropy bound does, from a diffusion model's counters (or their rates): denoising
    steps per committed token (lower: fewer passes a canvas, a higher bound) and the canvas's fill,
    committed tokens over canvas positions evaluated; None where nothing was committed."""
    return {"steps_per_committed_token": round(steps / committed, 5) if committed > 0 else None,
            "canvas_fill": round(committed / positions, 5) if positions > 0 else None}



# ---------------------------------------------------------------- a serving host, as top reads it

SERVING_HOST = Protocol("a serving host's figures", result={
    "targets": "its scrape targets (base64)", "replicas": "each replica unit -> its /metrics (base64)",
    "frontdoor": "its front door's stats page (base64)", "gpu": "the GPU collector's textfile (base64)"})
SERVING_HOST_PROGRAM = Program((PROGRAMS / "units.sh", PROGRAMS / "serving_host.sh"), SERVING_HOST)
PAGES = PROGRAMS / "pages.sh"
GATEWAY_READING = Protocol("a gateway's stats and usage", result={
    "stats": "its stats page, CSV: curl's rc and body (base64)",
    "usage": "its usage service's /metrics: curl's rc and body (base64)"})
GATEWAY_PROGRAM = Program((PAGES,), GATEWAY_READING)


def host_script(v: dict) -> str:
    """A serving host's own figures: its replicas (from its scrape targets), each one's
    /metrics on loopback, its front door's stats page, the GPU collector's textfile."""
    return SERVING_HOST_PROGRAM.script({**replica_units(v), "TARGETS": f"{FRONTDOOR.dir}/targets.json",
                                        "STATS_URL": f"http://127.0.0.1:{FRONTDOOR.metrics_port}/stats;csv",
                                        "GPU_TEXTFILE": f"{TEXTFILES}/gpu.prom"})


def gateway_script() -> str:
    """The gateway's stats page (each pool's front doors and their states) and its usage
    service's counts per key: `invoke status` reads the first, `invoke top` both."""
    return pages_script(GATEWAY_PROGRAM, {"stats": (5, f"http://127.0.0.1:{GATEWAY.metrics_port}/stats;csv"),
                                          "usage": (3, f"http://127.0.0.1:{USAGE_PORT}/metrics")})


def read_gateway(output: str) -> dict:
    """What `gateway_script` found: ``stats`` and ``usage`` (text; empty when it got none),
    ``error`` (why the stats page did not answer, None when it did)."""
    try:
        pages = read_pages(GATEWAY_READING, output)
    except ProgramResultError as exc:
        return {"stats": "", "usage": "", "error": str(exc)}
    return {"stats": pages["stats"][0], "usage": pages["usage"][0], "error": pages["stats"][1]}


@dataclass
class HostReading:
    """One reading of a serving host, at ``at``."""
    at: float
    replicas: dict  # index -> (labels of its target group, samples)
    frontdoor: list  # rows of its stats page
    gpu: list  # samples of the GPU textfile


def read_host(output: str, at: float, v: dict) -> HostReading:
    """A reading from `host_script`'s result (empty when the host gave none): each replica of
    its scrape targets with the samples of its unit's /metrics (none: it did not answer)."""
    try:
        found = SERVING_HOST.result_of(output)
    except ProgramResultError:
        found = {"targets": "", "replicas": {}, "frontdoor": "", "gpu": ""}
    metrics = {index: decoded(text, f"{ident.unit}'s /metrics")
               for index, (ident, text) in by_replica(v, found["replicas"]).items()}
    groups = {int(r["index"]): r for r in
              scrape_targets.replicas_of(scrape_targets.parse(decoded(found["targets"], "the scrape targets")))}
    replicas = {i: (groups[i], exposition.parse(metrics.get(i, ""))) for i in groups}
    return HostReading(at, replicas, stats_rows(decoded(found["frontdoor"], "the stats page")),
                       exposition.parse(decoded(found["gpu"], "the GPU textfile")))



# ---------------------------------------------------------------- a gateway

def parse_stats_csv(text: str) -> list[dict]:
    """The gateway's stats page as CSV (``/stats;csv``): each server of each pool (a model
    family's front doors) with its state (UP, DOWN, DRAIN, MAINT, ...), last check and
    seconds since it changed."""
    return [{"server": r["svname"], "pool": r["pxname"].removeprefix(POOL_PREFIX), "state": gateway_state(r["status"]),
             "check": r.get("check_status") or "",
             "since_s": int(r["lastchg"]) if (r.get("lastchg") or "").isdigit() else None}
            for r in server_rows(text, POOL_PREFIX)]


def gateway_state(status: str) -> str:
    """HAProxy's NOLB (a front door whose /health says 404: every replica of its host drained
    by a rolling deploy) is a drain as people call it; the rest as HAProxy says it."""
    return "DRAIN" + status[4:] if status.startswith("NOLB") else status


class GatewayServers(Fact):
    """Each server's state in the gateway, from its stats page on loopback."""

    command = gateway_script()

    def process(self, output, rc):
        found = read_gateway(output)
        return {"ok": found["error"] is None, "servers": parse_stats_csv(found["stats"]) if found["error"] is None
                else [], "error": found["error"]}



# ---------------------------------------------------------------- the alerts that fire

ALERTS = Protocol("Alertmanager's firing alerts", result={"alerts": "its answer: curl's rc and body (base64)"})
ALERTS_PROGRAM = Program((PAGES,), ALERTS)


class FiringAlerts(Fact):
    """The alerts Alertmanager holds as firing (active, neither silenced nor inhibited), from
    the monitoring host itself (it listens on loopback only), with the command each names."""

    def __init__(self, v: dict):
        port = int(v.get("alertmanager_port", 9093))
        self.command = pages_script(ALERTS_PROGRAM, {"alerts": (
            5, f"http://127.0.0.1:{port}/api/v2/alerts?active=true&silenced=false&inhibited=false")})

    def process(self, output, rc):
        try:
            body, error = read_pages(ALERTS, output)["alerts"]
        except ProgramResultError as exc:
            return {"error": str(exc), "alerts": []}
        if error is not None:
            return {"error": error, "alerts": []}
        try:
            alerts = json.loads(body)
        except ValueError:
            return {"error": f"Alertmanager answered what is not JSON: {body.strip()[:120]!r}", "alerts": []}
        return {"error": None, "alerts": sorted((firing(a) for a in alerts if isinstance(a, dict)),
                                                key=lambda a: (a["severity"] != "critical", a["alertname"], a["host"]))}


def firing(alert: dict, since: str = "startsAt") -> dict:
    """An alert as status and top show it, from Alertmanager's API (``startsAt``) or Prometheus's
    (``since="activeAt"``): what fires, where, and the command that mends it."""
    labels, notes = alert.get("labels") or {}, alert.get("annotations") or {}
    return {"alertname": labels.get("alertname", ""), "severity": labels.get("severity", ""),
            "host": labels.get("host", ""), "replica": labels.get("replica", ""), "server": labels.get("server", ""),
            "summary": notes.get("summary", ""), "fix": notes.get("fix", ""), "since": alert.get(since, "")}


