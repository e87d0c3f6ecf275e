"""`invoke status`: what runs where, and whether it drifted from the inventory."""
from __future__ import annotations

from converge.changes import Role

from serving.fleet import is_gateway, is_monitoring, is_serving
from serving.handoffs import CHOICE, UNITS
from converge.facts.containers import find_image
from serving.releases import Release, parse_history, rollback_target
from serving.replicas import installed, replica
from serving.serving_host import UNITS_FACT, record_path
from roles.shared_address.keepalived import holds

from .readings import FiringAlerts, GatewayServers, ServiceProbe


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
        choice = ctx.results.get(CHOICE)
        units = {i: pair for i, pair in installed(v, f.get(UNITS_FACT)).items()} or {0: (replica(v, 0), {})}
        declared = ctx.results.get(UNITS)
        planned = declared.by_index() if declared else {}
        # each replica as its front door sees it: UP, DRAIN (a roll under way), DOWN, MAINT
        in_front_door = f.get("frontdoor_servers") or {}
        replicas = []
        for index in sorted(set(units) | set(probes) | set(planned)):
            ident, unit = units.get(index) or (None, {})
            probe = probes.get(index) or {}
            plan = planned.get(index)
            ident = plan.replica if plan is not None else ident or replica(v, index)
            used = [gpus[u] for u in (plan.replica.gpus if plan else ()) if u in gpus] or \
                   ([next(iter(gpus.values()))] if gpus and index == 0 and not plan else [])
            replicas.append({
                "replica": index, "unit": ident.unit,
                "unit_state": f"{unit.get('ActiveState', '?')}/{unit.get('SubState', '?')}",
                "enabled": unit.get("UnitFileState"), "restarts": unit.get("NRestarts"),
                "container": probe.get("container", "absent"), "health": probe.get("health") or "no answer",
                "frontdoor": (in_front_door.get(ident.server) or {}).get("status") or None,
                "model": plan.served.model if plan else None, "planned": bool(plan),
                "gpus": [g.get("index") for g in used],
                # the diffusion settings it runs with now (its process's command line)
                "diffusion": probe.get("diffusion"),
                # what its entropy bound did since it started: denoising steps per committed token,
                # the canvas's fill (vLLM's diffusion counters)
                "denoising": probe.get("denoising"),
                # and its defaults for requests that set none (--override-generation-config)
                "generation": probe.get("generation"),
                # its load now: requests running and waiting, KV cache (vLLM's /metrics)
                "load": probe.get("load"),
                # what it would go back to (the host's release history), and whether that is still here
                "rollback": rollback_of(f, ident.unit),
                "since": unit.get("ActiveEnterTimestampMonotonic"),
                "gpu_memory_used_mib": sum(g.get("memory_used_mib") or 0 for g in used) if used else None,
                "gpu_memory_total_mib": sum(g.get("memory_total_mib") or 0 for g in used) if used else None})
        first = replicas[0]
        return {"status": {
            # the host's row is its first replica's; every replica has its own under "replicas"
            **{k: first[k] for k in ("unit", "unit_state", "enabled", "restarts", "container", "health", "since",
                                     "gpu_memory_used_mib", "gpu_memory_total_mib")},
            "model": choice.model if choice else None, "image": record[0] if record and record[0] else None,
            "digest": record[1] if len(record) > 1 else None, "replicas": replicas,
            "record": record_path(v)}}

    return Role("status", facts, lambda ctx: iter(()), summary=summary, hosts=is_serving)


def on_disk(facts, release: Release) -> dict:
    """Whether a release's image (by digest, else by its tag) and its weights (the commit's
    snapshot) are on the host, as the facts read them."""
    images = facts.get("images") or []
    image = next((i for i in images if release.digest and release.digest in i["digests"]), None) \
        or find_image(images, release.image)
    model = (facts.get("weights") or {}).get(release.model) or {}
    snapshot = (model.get("snapshots") or {}).get(release.commit) or {}
    return {"image": image is not None, "weights": bool(snapshot.get("files")) and not snapshot.get("broken")}


def rollback_of(facts, unit: str) -> dict | None:
    """A replica's rollback target (the release it ran before its current one) and what of it
    is still on the disk; None when the history names none."""
    releases = parse_history(((facts.get("release_history") or {}).get("content") or ""))
    target = rollback_target(releases, unit)
    if target is None:
        return None
    return {**target.as_dict(), "on_disk": on_disk(facts, target)}


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


def monitoring_status_role() -> Role:
    def summary(ctx):
        if ctx.facts is None:
            return {}
        seen = ctx.facts.get("firing_alerts") or {"error": "not read", "alerts": []}
        return {"monitoring": seen}

    return Role("monitoring status", lambda v: {"firing_alerts": FiringAlerts(v)}, lambda ctx: iter(()),
                summary=summary, hosts=is_monitoring)
