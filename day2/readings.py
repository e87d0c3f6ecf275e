"""Reading the fleet from its hosts: what `invoke status` and `invoke top` ask each host,
and how each answer reads. A serving host's replicas (their container, /health, load and
the command line in force; their /metrics), its front door's stats page and the GPU
collector's textfile; a gateway's servers; the alerts that fire. Both commands read the
fleet through this module alone."""
from __future__ import annotations

import base64
import json
import shlex
from dataclasses import dataclass

from converge.facts import Fact

from roles import scrape_targets
from roles.exporter_containers import TEXTFILES
from roles.gateway.accounting import USAGE_PORT
from roles.haproxy.instance import FRONTDOOR, GATEWAY
from roles.haproxy.stats import POOL_PREFIX, server_rows, stats_rows
from roles.replicas import replica, shell_functions, unit_globs
from roles.vllm_serve import diffusion_in_force, generation_in_force

from . import exposition


# ---------------------------------------------------------------- a serving host's replicas

class ServiceProbe(Fact):
    """Each replica's container state, /health and load (requests running and waiting, KV
    cache, from its /metrics), from the host itself: replica index -> {"container",
    "health", "load", "diffusion"}, for every replica unit the host has (replica 0 when none)."""

    def __init__(self, v):
        rt = shlex.quote(v.get("container_runtime", "podman"))
        first = replica(v, 0)
        self.command = (
            f"{shell_functions(v)}"
            f"units=$(for f in {' '.join(unit_globs(v))}; do [ -f \"$f\" ] && printf '%s ' \"${{f##*/}}\"; done); "
            f"[ -n \"$units\" ] || units={shlex.quote(first.unit)}; "
            f"for u in $units; do set -- $(replica_of_unit \"$u\"); [ $# = 3 ] || continue; i=$1; name=$2; port=$3; "
            f"pid=$(systemctl show -p MainPID --value \"$u\" 2>/dev/null); "
            # the command line it runs now (base64, one word): the settings in force, not the file's
            f"argv=$(base64 -w0 /proc/${{pid:-0}}/cmdline 2>/dev/null); "
            f"health=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://127.0.0.1:$port/health 2>/dev/null); "
            # vLLM's own gauges: requests running and waiting, KV cache ("-": no answer)
            f"load=$(curl -s --max-time 5 http://127.0.0.1:$port/metrics 2>/dev/null | awk "
            f"'/^vllm:num_requests_running[{{ ]/ {{ r += $NF }} /^vllm:num_requests_waiting[{{ ]/ {{ w += $NF }} "
            f"/^vllm:kv_cache_usage_perc[{{ ]/ {{ k = $NF; seen = 1 }} "
            f"END {{ if (seen) printf \"%g,%g,%g\", r, w, k; else printf \"-\" }}'); "
            f"printf '%s %s %s %s %s\\n' \"$i\" \"$({rt} inspect --format '{{{{.State.Status}}}}' \"$name\" "
            f"2>/dev/null || echo absent)\" \"${{health:--}}\" \"${{load:--}}\" \"${{argv:--}}\"; done")

    def process(self, output, rc):
        found = {}
        for line in output.splitlines():
            fields = line.split()
            if len(fields) != 5 or not fields[0].isdigit():
                continue
            index, container, health, load, encoded = fields
            # the command line it runs ("-": no process), base64 of its NUL-separated words
            argv = base64.b64decode(encoded).decode("utf-8", "replace").split("\0") if encoded != "-" else []
            found[int(index)] = {"container": container, "health": "" if health == "-" else health,
                                 "load": parse_load(load), "diffusion": diffusion_in_force(argv),
                                 "generation": generation_in_force(argv)}
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



# ---------------------------------------------------------------- a serving host, as top reads it

def host_script(v: dict) -> str:
    """A serving host's own figures: its replicas (from its scrape targets), each one's
    /metrics on loopback, its front door's stats page, the GPU collector's textfile."""
    targets = shlex.quote(f"{FRONTDOOR.dir}/targets.json")
    return (f"{shell_functions(v)}echo '@targets'; cat {targets} 2>/dev/null\n"
            f"for i in $(sed -n 's/.*\"replica\": \"\\([0-9]*\\)\".*/\\1/p' {targets} 2>/dev/null); do\n"
            f"  echo \"@replica $i\"; curl -sS --max-time 3 http://127.0.0.1:$(replica_port \"$i\")/metrics 2>/dev/null\n"
            f"done\n"
            f"echo '@frontdoor'; curl -sS --max-time 3 'http://127.0.0.1:{FRONTDOOR.metrics_port}/stats;csv' 2>/dev/null\n"
            f"echo '@gpu'; cat {shlex.quote(TEXTFILES + '/gpu.prom')} 2>/dev/null; true\n")


def gateway_script() -> str:
    """The gateway's stats page, as GatewayServers reads it for invoke status, and its usage
    service's counts per key (invoke top)."""
    return (f"echo '@gateway'; {GATEWAY_STATS} 2>/dev/null\n"
            f"echo '@usage'; curl -sS --max-time 3 http://127.0.0.1:{USAGE_PORT}/metrics 2>/dev/null; true\n")


def split_markers(output: str) -> dict[str, str]:
    parts, name = {}, None
    for line in output.splitlines():
        if line.startswith("@"):
            name = line[1:].strip()
            parts[name] = ""
        elif name is not None:
            parts[name] += line + "\n"
    return parts


@dataclass
class HostReading:
    """One reading of a serving host, at ``at``."""
    at: float
    replicas: dict  # index -> (labels of its target group, samples)
    frontdoor: list  # rows of its stats page
    gpu: list  # samples of the GPU textfile


def read_host(output: str, at: float) -> HostReading:
    parts = split_markers(output)
    groups = {int(r["index"]): r for r in scrape_targets.replicas_of(scrape_targets.parse(parts.get("targets", "")))}
    replicas = {i: (groups[i], exposition.parse(parts.get(f"replica {i}", ""))) for i in groups}
    return HostReading(at, replicas, stats_rows(parts.get("frontdoor", "")), exposition.parse(parts.get("gpu", "")))



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


GATEWAY_STATS = f"curl -sS --max-time 5 'http://127.0.0.1:{GATEWAY.metrics_port}/stats;csv'"


class GatewayServers(Fact):
    """Each server's state in the gateway, from its stats page on loopback."""

    command = f"{GATEWAY_STATS} 2>&1"

    def process(self, output, rc):
        return {"ok": rc == 0, "servers": parse_stats_csv(output) if rc == 0 else [],
                "error": None if rc == 0 else output.strip()[-200:]}



# ---------------------------------------------------------------- the alerts that fire

class FiringAlerts(Fact):
    """The alerts Alertmanager holds as firing (active, neither silenced nor inhibited), from
    the monitoring host itself (it listens on loopback only), with the command each names."""

    def __init__(self, v: dict):
        port = int(v.get("alertmanager_port", 9093))
        self.command = (f"curl -sS --max-time 5 'http://127.0.0.1:{port}/api/v2/alerts?active=true&silenced=false"
                        f"&inhibited=false' 2>&1")

    def process(self, output, rc):
        if rc != 0:
            return {"error": output.strip()[-200:] or f"curl exit {rc}", "alerts": []}
        try:
            alerts = json.loads(output)
        except ValueError:
            return {"error": f"Alertmanager answered what is not JSON: {output.strip()[:120]!r}", "alerts": []}
        return {"error": None, "alerts": sorted((firing(a) for a in alerts if isinstance(a, dict)),
                                                key=lambda a: (a["severity"] != "critical", a["alertname"], a["host"]))}


def firing(alert: dict, since: str = "startsAt") -> dict:
    """An alert as status and top show it, from Alertmanager's API (``startsAt``) or Prometheus's
    (``since="activeAt"``): what fires, where, and the command that mends it."""
    labels, notes = alert.get("labels") or {}, alert.get("annotations") or {}
    return {"alertname": labels.get("alertname", ""), "severity": labels.get("severity", ""),
            "host": labels.get("host", ""), "replica": labels.get("replica", ""), "server": labels.get("server", ""),
            "summary": notes.get("summary", ""), "fix": notes.get("fix", ""), "since": alert.get(since, "")}


