"""`invoke status`: what runs where, and whether it drifted from the inventory."""
from __future__ import annotations

import base64
import json
import shlex

from converge.changes import Role
from converge.facts import Fact

from roles.fleet import is_gateway, is_monitoring, is_serving
from roles.frontdoor.render import GATEWAY
from roles.frontdoor.stats import POOL_PREFIX, server_rows
from roles.serving_host import record_path

from roles.service.serve import diffusion_in_force
from roles.shared_address.keepalived import holds
from roles.replicas import installed, replica_name, replica_unit, units_shell


class ServiceProbe(Fact):
    """Each replica's container state, /health and load (requests running and waiting, KV
    cache, from its /metrics), from the host itself: replica index -> {"container",
    "health", "load", "diffusion"}, for every replica unit the host has (replica 0 when none)."""

    def __init__(self, v):
        rt = shlex.quote(v.get("container_runtime", "podman"))
        service = shlex.quote(replica_name(v, 0))
        base = int(v.get("replica_base_port", 8100))
        self.command = (
            f"{units_shell(v)}; "
            f"for u in $units; do i=${{u%.service}}; i=${{i#{rt}-}}; i=${{i#{service}}}; i=${{i#-}}; "
            f"name={service}${{i:+-$i}}; port=$(({base} + ${{i:-0}})); "
            f"pid=$(systemctl show -p MainPID --value \"$u\" 2>/dev/null); "
            # the command line it runs now (base64, one word): the settings in force, not the file's
            f"argv=$(base64 -w0 /proc/${{pid:-0}}/cmdline 2>/dev/null); "
            f"health=$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 http://127.0.0.1:$port/health 2>/dev/null); "
            # vLLM's own gauges: requests running and waiting, KV cache ("-": no answer)
            f"load=$(curl -s --max-time 5 http://127.0.0.1:$port/metrics 2>/dev/null | awk "
            f"'/^vllm:num_requests_running[{{ ]/ {{ r += $NF }} /^vllm:num_requests_waiting[{{ ]/ {{ w += $NF }} "
            f"/^vllm:kv_cache_usage_perc[{{ ]/ {{ k = $NF; seen = 1 }} "
            f"END {{ if (seen) printf \"%g,%g,%g\", r, w, k; else printf \"-\" }}'); "
            f"printf '%s %s %s %s %s\\n' \"${{i:-0}}\" \"$({rt} inspect --format '{{{{.State.Status}}}}' \"$name\" "
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
                                 "load": parse_load(load), "diffusion": diffusion_in_force(argv)}
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


def status_role() -> Role:
    def facts(v):
        return {"probe": ServiceProbe(v)}

    def summary(ctx):
        f, v = ctx.facts, ctx.vars
        if f is None:
            return {}
        nvidia = f.get("nvidia") or {}
        gpus = {g.get("uuid"): g for g in nvidia.get("gpus") or []}
        record = ((f.get("image_record") or {}).get("content") or "").split("\n")
        probes = f.get("probe") or {}
        units = installed(v, f.get("unit"), f.get("replica_units")) or {0: f.get("unit") or {}}
        planned = {r["index"]: r for r in ctx.desired.get("replicas") or []}
        # each replica as its front door sees it: UP, DRAIN (a roll under way), DOWN, MAINT
        in_front_door = f.get("frontdoor_servers") or {}
        replicas = []
        for index in sorted(set(units) | set(probes) | set(planned)):
            unit = units.get(index) or {}
            probe = probes.get(index) or {}
            plan = planned.get(index) or {}
            used = [gpus[u] for u in plan.get("gpus", []) if u in gpus] or \
                   ([next(iter(gpus.values()))] if gpus and index == 0 and not plan else [])
            replicas.append({
                "replica": index, "unit": replica_unit(v, index),
                "unit_state": f"{unit.get('ActiveState', '?')}/{unit.get('SubState', '?')}",
                "enabled": unit.get("UnitFileState"), "restarts": unit.get("NRestarts"),
                "container": probe.get("container", "absent"), "health": probe.get("health") or "no answer",
                "frontdoor": (in_front_door.get(f"replica{index}") or {}).get("status") or None,
                "model": plan.get("model"), "planned": bool(plan), "gpus": [g.get("index") for g in used],
                # the diffusion settings it runs with now (its process's command line)
                "diffusion": probe.get("diffusion"),
                # its load now: requests running and waiting, KV cache (vLLM's /metrics)
                "load": probe.get("load"),
                "since": unit.get("ActiveEnterTimestampMonotonic"),
                "gpu_memory_used_mib": sum(g.get("memory_used_mib") or 0 for g in used) if used else None,
                "gpu_memory_total_mib": sum(g.get("memory_total_mib") or 0 for g in used) if used else None})
        first = replicas[0]
        return {"status": {
            # the host's row is its first replica's; every replica has its own under "replicas"
            **{k: first[k] for k in ("unit", "unit_state", "enabled", "restarts", "container", "health", "since",
                                     "gpu_memory_used_mib", "gpu_memory_total_mib")},
            "model": ctx.desired.get("model"), "image": record[0] if record and record[0] else None,
            "digest": record[1] if len(record) > 1 else None, "replicas": replicas,
            "record": record_path(v)}}

    return Role("status", facts, lambda ctx: iter(()), summary=summary, hosts=is_serving)


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

    command = f"curl -sS --max-time 5 'http://127.0.0.1:{GATEWAY.metrics_port}/stats;csv' 2>&1"

    def process(self, output, rc):
        return {"ok": rc == 0, "servers": parse_stats_csv(output) if rc == 0 else [],
                "error": None if rc == 0 else output.strip()[-200:]}


def gateway_status_role() -> Role:
    def summary(ctx):
        if ctx.facts is None:
            return {}
        seen = ctx.facts.get("gateway_servers") or {}
        out = {"gateway_servers": seen.get("servers", []), "gateway_error": seen.get("error") or None}
        shared = ctx.vars.get("gateway_address")
        if shared:
            # whether this gateway holds the shared address now (the shared address role's facts)
            unit = ctx.facts.get("keepalived_unit") or {}
            out["shared_address"] = {"address": shared,
                                     "held": holds(shared, ctx.facts.get("ipv4_addresses") or []),
                                     "keepalived": unit.get("ActiveState", "?")}
        return out

    return Role("gateway status", lambda v: {"gateway_servers": GatewayServers()}, lambda ctx: iter(()),
                summary=summary, hosts=is_gateway)


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


def firing(alert: dict) -> dict:
    labels, notes = alert.get("labels") or {}, alert.get("annotations") or {}
    return {"alertname": labels.get("alertname", ""), "severity": labels.get("severity", ""),
            "host": labels.get("host", ""), "replica": labels.get("replica", ""), "server": labels.get("server", ""),
            "summary": notes.get("summary", ""), "fix": notes.get("fix", ""), "since": alert.get("startsAt", "")}


def monitoring_status_role() -> Role:
    def summary(ctx):
        if ctx.facts is None:
            return {}
        seen = ctx.facts.get("firing_alerts") or {"error": "not read", "alerts": []}
        return {"monitoring": seen}

    return Role("monitoring status", lambda v: {"firing_alerts": FiringAlerts(v)}, lambda ctx: iter(()),
                summary=summary, hosts=is_monitoring)
