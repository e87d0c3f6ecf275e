"""frontdoor: HAProxy in front of vLLM on every serving host: TLS from the fleet
CA (or the user's own certificate), an allowlist of routes, a key for everything
but /health (the host holds only the keys' sha256), vLLM's replicas on loopback.
The steps are proxy.py's, shared with the gateway."""
from __future__ import annotations

import shlex
from dataclasses import replace

from converge.changes import Command, File, Role
from converge.facts.host import UnitFiles, UnitState
from converge.facts.nvidia import Dcgm

from roles import scrape_targets
from roles.fleet import is_serving
from roles.replicas import installed, more_units_glob, replica_port
from roles.serving_host import env_path, unit_name

from roles.preflight.declared import DEFAULT_FAMILY, served_name

from . import proxy, tls
from .pools import frontdoor_pools, pools_in_config, queue_rule
from .admin import ADMIN_SOCKET, FRONTDOOR_SHELL
from .render import FRONTDOOR, Server
from .stats import ServerStates


def facts(v):
    # which replicas the host has, for a run that does not place them (keys add, revoke)
    return {**proxy.facts(v, FRONTDOOR, "frontdoor"), "unit": UnitState(unit_name(v)),
            "replica_units": UnitFiles(more_units_glob(v)),
            # replicas it holds out of service (a rolling deploy's drain that did not end)
            "frontdoor_servers": ServerStates(ADMIN_SOCKET),
            # NVIDIA's DCGM exporter is scraped where the host engine runs (roles/exporters)
            "dcgm": Dcgm()}


def servers(ctx) -> list[Server]:
    """vLLM's replicas on this host, on loopback: those this deploy places, or else
    those the host has (replica 0 alone on a host that has none yet)."""
    v = ctx.vars
    if "replicas" in ctx.desired:
        indices = [r["index"] for r in ctx.desired["replicas"]]
    else:
        indices = list(installed(v, ctx.facts.get("unit"), ctx.facts.get("replica_units"))) or [0]
    return [Server(f"replica{i}", f"127.0.0.1:{replica_port(v, i)}") for i in indices]


def pools(ctx, replicas: list[Server]) -> list:
    """The host's replicas by family: as this deploy places them, or (a run that places
    nothing) as the running configuration groups them."""
    v = ctx.vars
    if "replicas" in ctx.desired:
        families = {r["index"]: r["family"] for r in ctx.desired["replicas"]}
    else:
        running = pools_in_config((ctx.facts.get("frontdoor_config") or {}).get("content") or "")
        indices = (int(s.name.removeprefix("replica")) for s in replicas)
        families = {i: running.get(i, DEFAULT_FAMILY) for i in indices}
    aliases = {f: served_name(f, v) for f in set(families.values())}
    return [replace(pool, queue=queue_rule(v, pool.name)) for pool in frontdoor_pools(families, aliases, replicas)]


def targets(ctx) -> str:
    """What the monitoring hosts scrape here, with each replica's labels: as this deploy places
    the replicas; a run that places nothing (keys add, revoke) keeps what the host serves."""
    if "replicas" not in ctx.desired:
        return ((ctx.facts.get("frontdoor_targets") or {}).get("content") or "")
    dcgm = scrape_targets.uses_dcgm(ctx.vars, ctx.facts.get("dcgm"))
    return scrape_targets.render(scrape_targets.host_targets(ctx.name, ctx.vars, ctx.desired["replicas"], dcgm=dcgm))


def wanted(ctx) -> proxy.Wanted:
    fleet = ctx.services.get("fleet")
    # the gateway reaches the front doors with a key of its own
    accepted = tls.accepted_keys(ctx.name, ctx.vars, gateway=bool(fleet and fleet.has_gateway))
    replicas = servers(ctx)
    sd = targets(ctx)
    # the DCGM exporter's route as the targets name it (a keys run: as the host serves them)
    dcgm = any(g.get("labels", {}).get("job") == scrape_targets.GPU_JOB for g in scrape_targets.parse(sd))
    return proxy.wanted(ctx, FRONTDOOR, replicas, accepted, pools=pools(ctx, replicas), targets=sd, dcgm=dcgm)


def plan(ctx):
    v = ctx.vars
    want = wanted(ctx)
    ctx.desired["frontdoor_generation"] = want.generation
    # the unit reads vLLM's key from vLLM's environment file: a new key there is a restart
    env_changed = any(isinstance(s, File) and s.path == env_path(v) and s.content_changed()
                      for s in ctx.changed_steps)
    yield back_in_service(ctx)
    yield from proxy.steps(ctx, FRONTDOOR, "frontdoor", want, env_path(v), env_changed)


def back_in_service(ctx) -> Command:
    """A replica the front door still holds drained (a roll cut short by a reboot or SIGKILL of
    its script, which otherwise puts it back itself) is put back, and the roll's flag lowered:
    deploy never leaves one out."""
    states = ctx.facts.get("frontdoor_servers") or {}
    drained = [name for name, state in states.items() if state["status"].startswith("DRAIN")]
    indices = [name.removeprefix("replica") for name in drained if name.removeprefix("replica").isdigit()]
    script = (f"ADMIN={shlex.quote(ADMIN_SOCKET)}\n{FRONTDOOR_SHELL}\n"
              + "".join(f"I={int(i)}; admin ready || {{ echo \"replica{int(i)} is still drained\"; exit 1; }}\n"
                        for i in indices) + "flag maint || true\n"
              + 'for p in $(raised_pool_flags); do pool_flag "$p" maint || true; done\n')
    return Command("replicas in service", script=script, when=bool(indices),
                   describe=f"{', '.join(drained)} left drained in the front door (a rolling deploy cut short): "
                            f"back in service")


def plan_keys(ctx):
    yield from proxy.reload_steps(ctx, FRONTDOOR, "frontdoor", wanted(ctx))


ROLE = Role("frontdoor", facts, plan, summary=lambda ctx: proxy.summary(ctx, FRONTDOOR, "frontdoor"),
            hosts=is_serving)
KEYS_ROLE = Role("frontdoor keys", facts, plan_keys, hosts=is_serving)
