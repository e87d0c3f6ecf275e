"""frontdoor: HAProxy in front of vLLM on every serving host: TLS from the fleet
CA (or the user's own certificate), an allowlist of routes, a key for everything
but /health (the host holds only the keys' sha256), vLLM's replicas on loopback.
The steps are proxy.py's, shared with the gateway."""
from __future__ import annotations

from converge.changes import File, Role

from roles.fleet import is_serving
from roles.service.role import env_path

from . import proxy, tls
from .render import FRONTDOOR, Server


def facts(v):
    return proxy.facts(v, FRONTDOOR, "frontdoor")


def servers(ctx) -> list[Server]:
    """vLLM's replicas on this host, on loopback."""
    port = int(ctx.vars.get("replica_base_port", 8100))
    return [Server("replica0", f"127.0.0.1:{port}")]


def wanted(ctx) -> proxy.Wanted:
    fleet = ctx.services.get("fleet")
    # the gateway reaches the front doors with a key of its own
    accepted = tls.accepted_keys(ctx.name, ctx.vars, gateway=bool(fleet and fleet.has_gateway))
    return proxy.wanted(ctx, FRONTDOOR, servers(ctx), accepted)


def plan(ctx):
    v = ctx.vars
    want = wanted(ctx)
    ctx.desired["frontdoor_generation"] = want.generation
    # the unit reads vLLM's key from vLLM's environment file: a new key there is a restart
    env_changed = any(isinstance(s, File) and s.path == env_path(v) and s.content_changed()
                      for s in ctx.changed_steps)
    yield from proxy.steps(ctx, FRONTDOOR, "frontdoor", want, env_path(v), env_changed)


def plan_keys(ctx):
    yield from proxy.reload_steps(ctx, FRONTDOOR, "frontdoor", wanted(ctx))


ROLE = Role("frontdoor", facts, plan, summary=lambda ctx: proxy.summary(ctx, FRONTDOOR, "frontdoor"),
            hosts=is_serving)
KEYS_ROLE = Role("frontdoor keys", facts, plan_keys, hosts=is_serving)
