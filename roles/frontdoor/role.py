"""frontdoor: HAProxy in front of vLLM on every serving host: TLS from the fleet
CA (or the user's own certificate), an allowlist of routes, a key for everything
but /health (the host holds only the keys' sha256), vLLM's replicas on loopback.
The steps are proxy.py's, shared with the gateway."""
from __future__ import annotations

import re
from dataclasses import replace

from converge.changes import Command, Decision, File, Role
from converge.errors import StepFailed
from converge.facts.nvidia import Dcgm
from credentials import CredentialError, directory
from credentials.keys import KeyStore

from serving import catalog, gateway_leftovers, key_limits as limits, monitoring_leftovers, scrape_targets
from serving.declared import DEFAULT_FAMILY, is_diffusion, served_name
from serving.fleet import is_serving
from serving.handoffs import FRONTDOOR_GENERATION, UNITS
from serving.haproxy import steps as proxy, tls
from serving.haproxy.admin import ADMIN_SOCKET, ROLLING_BACKEND, admin_parameters
from serving.haproxy.config import Server
from serving.haproxy.instance import FRONTDOOR
from serving.haproxy.pools import frontdoor_pools, pools_in_config, queue_rule
from serving.haproxy.stats import ServerStates
from serving.host_programs import ProgramResultError
from serving.replicas import installed, replica, server_index
from serving.serving_host import UNITS_FACT, env_path, units_fact
from serving.vllm_serve import diffusion_wanted

from .back import BACK, BACK_PROGRAM


def facts(v):
    # which replicas the host has, for a run that does not place them (keys add, revoke)
    return {**proxy.facts(v, FRONTDOOR, "frontdoor"), **units_fact(v),
            # replicas it holds out of service (a rolling deploy's drain that did not end)
            "frontdoor_servers": ServerStates(ADMIN_SOCKET),
            # the roll's flags (the host's, each pool's): one left up holds the host out at the gateways
            "frontdoor_flags": ServerStates(ADMIN_SOCKET, backend=ROLLING_BACKEND),
            # NVIDIA's DCGM exporter is scraped where the host engine runs (roles/exporters)
            "dcgm": Dcgm(),
            # a gateway, or a Prometheus, it ran before it left the group `gateway` or `monitoring`
            **gateway_leftovers.facts(v), **monitoring_leftovers.facts(v)}


def keys_facts(v):
    # a keys run rewrites the key lists and the configuration naming the replicas the host has
    return {**proxy.keys_facts(v, FRONTDOOR, "frontdoor"), **units_fact(v)}


def _replicas(ctx) -> list:
    """vLLM's replicas on this host: those this deploy places, or else those the host has
    (replica 0 alone on a host that has none yet)."""
    declared = ctx.results.get(UNITS)
    if declared is not None:
        return [plan.replica for plan in declared.replicas]
    found = [ident for ident, _ in installed(ctx.vars, ctx.facts.get(UNITS_FACT)).values()]
    return found or [replica(ctx.vars, 0)]


def servers(ctx) -> list[Server]:
    """vLLM's replicas on this host, on loopback, as the front door's servers."""
    return [Server(r.server, r.address, replica=r.index) for r in _replicas(ctx)]


def pools(ctx, replicas: list[Server]) -> list:
    """The host's replicas by family: as this deploy places them, or (a run that places
    nothing) as the running configuration groups them."""
    v = ctx.vars
    if ctx.results.get(UNITS) is not None:
        families = {r.server: r.family for r in _replicas(ctx)}
    else:
        running = pools_in_config((ctx.facts.get("frontdoor_config") or {}).get("content") or "")
        families = {s.name: running.get(s.name, DEFAULT_FAMILY) for s in replicas}
    aliases = {f: served_name(f, v) for f in set(families.values())}
    families_info = catalog.models()["families"]
    return [replace(pool, queue=queue_rule(v, pool.name),
                    ignored=tuple(families_info.get(pool.name, {}).get("ignored_parameters") or ()),
                    refuse_ignored=v.get("ignored_parameters", "header") == "refuse")
            for pool in frontdoor_pools(families, aliases, replicas)]


DIFFUSION_HEADER = re.compile(r'set-header X-Dgemma-Diffusion "([^"]*)" if \{ srv_name -m str (\S+) \}')


def diffusion(ctx) -> dict[str, str]:
    """Each DiffusionGemma replica's diffusion settings, as its answers name them (server name ->
    ``name=value ...``): as this deploy declares the replicas, or (a run that declares none) as
    the running configuration names them."""
    declared = ctx.results.get(UNITS)
    if declared is None:
        running = (ctx.facts.get("frontdoor_config") or {}).get("content") or ""
        return {server: settings for settings, server in DIFFUSION_HEADER.findall(running)}
    return {plan.replica.server: " ".join(f"{k}={x}" for k, x in diffusion_wanted(plan.served.variables(ctx.vars)).items())
            for plan in declared.replicas if is_diffusion(plan.replica.family)}


def targets(ctx) -> str:
    """What the monitoring hosts scrape here, with each replica's labels: as this deploy places
    the replicas; a run that places nothing (keys add, revoke) keeps what the host serves."""
    declared = ctx.results.get(UNITS)
    if declared is None:
        return ((ctx.facts.get("frontdoor_targets") or {}).get("content") or "")
    dcgm = scrape_targets.uses_dcgm(ctx.vars, ctx.facts.get("dcgm"))
    return scrape_targets.render(scrape_targets.host_targets(ctx.name, ctx.vars, [p.served for p in declared.replicas], dcgm=dcgm))


def wanted(ctx) -> proxy.Wanted:
    fleet = ctx.services.get("fleet")
    # the gateway reaches the front doors with a key of its own
    accepted = tls.accepted_keys(ctx.name, ctx.vars, gateway=bool(fleet and fleet.has_gateway), make=not ctx.check)
    if fleet and fleet.has_gateway:
        # a key with limits comes through the gateways, which enforce them: the front doors refuse it
        try:
            own = KeyStore(directory(ctx.vars)).limits()
        except CredentialError as exc:
            raise StepFailed(f"{ctx.name}: {exc}") from exc
        accepted = limits.unlimited_only(accepted, own, ctx.vars.get("key_limits"))
    replicas = servers(ctx)
    sd = targets(ctx)
    # the DCGM exporter's route as the targets name it (a keys run: as the host serves them)
    dcgm = any(g.get("labels", {}).get("job") == scrape_targets.GPU_JOB for g in scrape_targets.parse(sd))
    return proxy.wanted(ctx, FRONTDOOR, replicas, accepted, pools=pools(ctx, replicas), targets=sd, dcgm=dcgm,
                        diffusion=diffusion(ctx))


def plan(ctx):
    v = ctx.vars
    fleet = ctx.services.get("fleet")
    yield from tls.made_step(ctx, (tls.MONITORING_KEY,) + ((tls.GATEWAY_KEY,) if fleet and fleet.has_gateway else ()))
    want = wanted(ctx)
    yield Decision("generation", produces=FRONTDOOR_GENERATION, value=want.generation)
    # the unit reads vLLM's key from vLLM's environment file: a new key there is a restart
    env_changed = any(isinstance(s, File) and s.path == env_path(v) and s.content_changed()
                      for s in ctx.changed_steps)
    yield back_in_service(ctx)
    # before the front door moves back to api_port, which a gateway left behind holds
    yield from gateway_leftovers.removal(ctx)
    yield from monitoring_leftovers.removal(ctx)
    yield from proxy.steps(ctx, FRONTDOOR, "frontdoor", want, env_path(v), env_changed)


def back_in_service(ctx) -> Command:
    """A replica the front door still holds drained (a roll cut short by a reboot or SIGKILL of
    its script, which otherwise puts it back itself) is put back, and the roll's flag lowered:
    deploy never leaves one out."""
    states = ctx.facts.get("frontdoor_servers") or {}
    drained = [name for name, state in states.items()
               if state["status"].startswith("DRAIN") and server_index(name) is not None]
    # a flag is lowered when its server is in MAINT; any other state is a flag left up (the roll's
    # "Mend it: invoke deploy" for a flag it could not lower), even with every replica in service
    raised = sorted(name for name, state in (ctx.facts.get("frontdoor_flags") or {}).items()
                    if not state["status"].startswith("MAINT"))
    left = drained + [f"the roll's flag {name}" for name in raised]

    def interpret(result):
        try:
            said = BACK.result_of(result.stdout)
        except ProgramResultError as exc:
            raise StepFailed(f"putting {', '.join(left)} back in service failed (exit {result.rc}): {exc}") from None
        servers, flags = str(said["refused"]).split(), str(said["flags_refused"]).split()
        if servers or flags:
            what = [f"to put {', '.join(servers)} back in service"] if servers else []
            what += [f"to lower the roll's flag{'s' if len(flags) > 1 else ''} {', '.join(flags)}"] if flags else []
            put_back = f" ({said['in_service']} put back)" if said["in_service"] else ""
            raise StepFailed(f"the front door refused {' and '.join(what)}{put_back}: see journalctl -u "
                             f"{FRONTDOOR.unit_name(ctx.vars)}, then invoke deploy --hosts {ctx.name} again")
        return f"{', '.join(drained)} back in service" if not raised else \
            f"{', '.join(drained) + ' back in service, ' if drained else ''}the roll's flags lowered ({', '.join(raised)})"
    return Command("replicas in service", when=bool(left), interpret=interpret,
                   script=BACK_PROGRAM.script({**admin_parameters(), "SERVERS": " ".join(drained)}),
                   describe=f"{', '.join(left)} left {'drained' if drained else 'up'} in the front door (a rolling "
                            f"deploy cut short): back in service")


def plan_keys(ctx):
    yield from proxy.reload_steps(ctx, FRONTDOOR, "frontdoor", wanted(ctx))


ROLE = Role("frontdoor", facts, plan, summary=lambda ctx: proxy.summary(ctx, FRONTDOOR, "frontdoor", FRONTDOOR_GENERATION),
            hosts=is_serving)
KEYS_ROLE = Role("frontdoor keys", keys_facts, plan_keys, hosts=is_serving)
