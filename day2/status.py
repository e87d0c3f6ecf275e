"""`invoke status`: what runs where, and whether it drifted from the inventory."""
from __future__ import annotations

import csv
import io
import shlex

from converge.changes import Role
from converge.facts import Fact

from roles.fleet import is_gateway, is_serving
from roles.frontdoor.render import GATEWAY
from roles.image.role import record_path
from roles.service.role import unit_name


class ServiceProbe(Fact):
    """Container state and /health, from the host itself."""

    def __init__(self, v):
        rt = shlex.quote(v.get("container_runtime", "podman"))
        name = shlex.quote(v.get("service_name", "vllm-diffusiongemma"))
        url = shlex.quote(f"http://127.0.0.1:{v.get('replica_base_port', 8100)}/health")  # vLLM, on loopback
        self.command = (f"printf 'container=%s\\n' \"$({rt} inspect --format '{{{{.State.Status}}}}' {name} "
                        f"2>/dev/null || echo absent)\"; "
                        f"printf 'health=%s\\n' \"$(curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 {url} "
                        f"2>/dev/null)\"")

    def process(self, output, rc):
        return dict(line.split("=", 1) for line in output.splitlines() if "=" in line)


def status_role() -> Role:
    def facts(v):
        return {"probe": ServiceProbe(v)}

    def summary(ctx):
        f, v = ctx.facts, ctx.vars
        if f is None:
            return {}
        unit = f.get("unit") or {}
        nvidia = f.get("nvidia") or {}
        gpus = nvidia.get("gpus") or [{}]
        record = ((f.get("image_record") or {}).get("content") or "").split("\n")
        probe = f.get("probe") or {}
        return {"status": {
            "unit": unit_name(v), "unit_state": f"{unit.get('ActiveState', '?')}/{unit.get('SubState', '?')}",
            "enabled": unit.get("UnitFileState"), "restarts": unit.get("NRestarts"),
            "container": probe.get("container"), "health": probe.get("health") or "no answer",
            "model": ctx.desired.get("model"), "image": record[0] if record and record[0] else None,
            "digest": record[1] if len(record) > 1 else None,
            "since": unit.get("ActiveEnterTimestampMonotonic"),
            "gpu_memory_used_mib": gpus[0].get("memory_used_mib"),
            "gpu_memory_total_mib": gpus[0].get("memory_total_mib"),
            "record": record_path(v)}}

    return Role("status", facts, lambda ctx: iter(()), summary=summary, hosts=is_serving)


def parse_stats_csv(text: str) -> list[dict]:
    """HAProxy's stats page as CSV (``/stats;csv``): each server of the backend with
    its state (UP, DOWN, DRAIN, MAINT, ...), last check and seconds since it changed."""
    rows = csv.DictReader(io.StringIO(text.lstrip("# ")))
    return [{"server": r["svname"], "state": r["status"], "check": r.get("check_status") or "",
             "since_s": int(r["lastchg"]) if (r.get("lastchg") or "").isdigit() else None}
            for r in rows if r.get("pxname") == "servers" and r.get("svname") not in ("FRONTEND", "BACKEND")]


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
        return {"gateway_servers": seen.get("servers", []),
                "gateway_error": seen.get("error") or None}

    return Role("gateway status", lambda v: {"gateway_servers": GatewayServers()}, lambda ctx: iter(()),
                summary=summary, hosts=is_gateway)
