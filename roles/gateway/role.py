"""gateway: on the hosts of the inventory group `gateway`, one address for the
whole fleet: the front door's HAProxy (TLS, keys, allowlist), balancing over every
serving host's front door over TLS checked against the fleet CA.

It takes a server out within about two seconds of failing /health (checks every
second, two failures) and back after two good ones; a request that reached no
server, or got no answer at all (a link cut mid-request is found by TCP
keepalives), is tried on another one, so a host going down costs no failed
non-streaming request. It reaches the front doors with a key of its own, which
only this host holds (in a 0600 environment file); an external fallback's key sits
in a 0600 map beside its configuration, so that setting or changing one is a reload."""
from __future__ import annotations

from converge.changes import Check, Decision, File, Role
from converge.errors import SecretError
from converge.facts.host import FileState
from converge.secrets import read_secret_file
from credentials import CredentialError, directory
from credentials.ca import ca_pem, peer_certificate, peer_certificate_due
from credentials.keys import KeyStore, service_key

from serving import scrape_targets
from serving.fleet import SHARED_ADDRESS_UNIT, is_gateway, is_serving, shared_address
from serving.handoffs import GATEWAY_GENERATION
from serving.haproxy import steps as proxy, tls
from serving.haproxy.config import Server
from serving.haproxy.instance import (CONTAINER_DIR, GATEWAY, GATEWAY_CHECK_INTERVAL_S, GATEWAY_CHECK_TIMEOUT_S,
                                     GATEWAY_ENV_FILE, LIVE_ANSWERS, live_answers)
from serving.haproxy.reach import reach_step
from serving.haproxy.pools import UPSTREAM_KEYS, fleet_families, gateway_pools, render_upstream_keys, serving

from serving import accounting
from serving.gateway_checks import refusals
from serving import key_limits as limits

from . import usage_steps

# checks every second, a server out after two failures. A request's connect to a front door (its TLS
# handshake included) gives up after 3 s and is tried on another: a busy gateway's handshakes wait
# behind its own traffic (80 at once on a gateway kept to two threads took over a second), while a
# check's connect keeps to its interval, a second (HAProxy's min(timeout connect, inter)), so that
# a dead host is out in 2-3 s as before
BACKEND = {"connect_timeout": "3s", "check_timeout": f"{GATEWAY_CHECK_TIMEOUT_S}s", "inter": f"{GATEWAY_CHECK_INTERVAL_S}s", "tcp_keepalive": True}


def keys_facts(v):
    # a keys run rewrites the key lists and what the generation counts besides (the upstream keys,
    # the peer certificate, the keys' names and limits)
    return {**proxy.keys_facts(v, GATEWAY, "gateway"),
            "gateway_upstream_keys": FileState(f"{GATEWAY.dir}/{UPSTREAM_KEYS}", secret=True),
            "gateway_peer_pem": FileState(f"{GATEWAY.dir}/{accounting.PEER_PEM}", secret=True),
            "gateway_peers_ca": FileState(f"{GATEWAY.dir}/{accounting.PEERS_CA}"),
            "gateway_live_answers": FileState(f"{GATEWAY.dir}/{LIVE_ANSWERS}"),
            **usage_steps.map_facts(v)}


def facts(v):
    return {**proxy.facts(v, GATEWAY, "gateway"), **keys_facts(v), "gateway_env": FileState(GATEWAY_ENV_FILE, secret=True),
            **usage_steps.facts(v)}


def servers(fleet, doors=None) -> list[Server]:
    """The front doors (``doors``, or every serving host's) as the gateway's servers."""
    out = []
    for door in fleet.serving if doors is None else doors:
        address = f"[{door.address}]" if ":" in door.address else door.address
        # the front door's certificate names the host's inventory name: checked, and sent as SNI
        out.append(Server(door.host, f"{address}:{door.port}",
                          f" ssl verify required ca-file {CONTAINER_DIR}/ca.crt verifyhost {door.host} "
                          f"sni str({door.host}) check-sni {door.host}"))
    return out


def upstream_keys(ctx) -> str:
    """The map of each external fallback's key, read on the control machine (SecretError
    names the file and the key of the inventory)."""
    keys = {}
    for family, rule in sorted((ctx.vars.get("model_fallback") or {}).items()):
        if rule.get("url"):
            where = f"model_fallback.{family}.key_file"
            key = read_secret_file(rule["key_file"], where, ctx.name).strip()
            if any(c.isspace() for c in key):
                raise SecretError(f"{ctx.name}: {where}: {rule['key_file']} holds blanks inside the key; an API key "
                                  f"is one word: write it alone on the line")
            keys[family] = key
    return render_upstream_keys(keys)


def rendered_from(name: str, v: dict, fleet) -> dict:
    """What host ``name``'s gateway configuration is rendered from besides its variables
    (config.render_config's servers, backend, pools and accounting): deploy's, and the loopback
    bench's (bench/gateway/loopback.py renders its gateways with it)."""
    return {"servers": servers(fleet), "backend": BACKEND,
            "pools": gateway_pools(fleet, lambda doors: servers(fleet, doors), v.get("model_fallback")),
            "accounting": accounting.accounting(name, v, {door.host: door.address for door in fleet.gateways})}


def wanted(ctx, upstream_map: str, accepted: dict[str, str], maps: tuple) -> proxy.Wanted:
    """``accepted``: each key's name -> its sha256; ``maps``: the files of the keys' names and limits
    (usage_steps.map_files), which the generation counts as it counts the upstream keys."""
    fleet = ctx.services.get("fleet")
    # front doors with a certificate of their own: the gateway trusts their CAs too
    own_cas = tuple(dict.fromkeys(door.ca_file for door in fleet.serving if door.ca_file))
    inputs = rendered_from(ctx.name, ctx.vars, fleet)
    return proxy.wanted(ctx, GATEWAY, inputs["servers"], accepted, inputs["backend"], own_cas, pools=inputs["pools"],
                        secret_files=upstream_map + "".join(f.content for f in maps),
                        targets=scrape_targets.render(scrape_targets.host_targets(
                            ctx.name, ctx.vars, [], gateway=True, node=not is_serving(ctx.vars))),
                        accounting=inputs["accounting"])


def keys_and_limits(ctx) -> tuple[dict[str, str], tuple]:
    """The accepted keys (name -> sha256) and the files of their names and limits (CredentialError
    or StepFailed when the key store cannot be read)."""
    accepted = tls.accepted_keys(ctx.name, ctx.vars, make=not ctx.check)
    store = KeyStore(directory(ctx.vars))
    own = store.limits()
    wrong = [p for name, mine in own.items() for p in limits.problems(mine, f"{store.path}: {name}.limits")]
    if wrong:
        raise CredentialError("; ".join(wrong) + ": set them again with invoke keys.set (or edit the file)")
    in_force = usage_steps.limits_in_force(own, accepted, ctx.vars.get("key_limits"))
    return accepted, usage_steps.map_files(ctx, accepted, in_force)


def peer_files(ctx) -> tuple[File, File]:
    """The gateway's certificate among its peers with its key, and the fleet CA it takes peers
    from (CredentialError when the control machine's credentials cannot be read)."""
    folder = directory(ctx.vars)
    issued = peer_certificate(folder, ctx.name, make=not ctx.check)
    return (File("gateway peer certificate", path=f"{GATEWAY.dir}/{accounting.PEER_PEM}",
                 content=issued.cert_pem + issued.key_pem, mode="0600", secret=True,
                 current=ctx.facts.get("gateway_peer_pem"), keep_previous=False),
            File("gateway peers' CA", path=f"{GATEWAY.dir}/{accounting.PEERS_CA}",
                 content=ca_pem(folder, make=not ctx.check), mode="0644", current=ctx.facts.get("gateway_peers_ca")))


def upstream_keys_file(ctx, content: str) -> File:
    # no previous version kept: a key taken out of the policy leaves the host with it
    return File("gateway upstream keys", path=f"{GATEWAY.dir}/{UPSTREAM_KEYS}", content=content, mode="0600",
                secret=True, current=ctx.facts.get("gateway_upstream_keys"), keep_previous=False)


def plan(ctx):
    fleet = ctx.services.get("fleet")
    refused = refusals(ctx.vars, ctx.facts, fleet)
    if refused:
        yield from refused
        return
    if not is_serving(ctx.vars):  # a gateway that serves asked in preflight, before its front door moved aside
        yield reach_step(ctx.name, fleet.serving)
    yield from tls.made_step(ctx, (tls.GATEWAY_KEY, tls.MONITORING_KEY),
                             also=[f"{ctx.name}'s peer certificate"]
                             if peer_certificate_due(directory(ctx.vars), ctx.name) else [])
    try:
        key = service_key(directory(ctx.vars), tls.GATEWAY_KEY, make=not ctx.check)
    except CredentialError as exc:
        yield Check("gateway key", ok=False, message=str(exc))
        return
    read = yield from generation_inputs(ctx)
    if read is None:
        return
    upstream_map, accepted, maps = read
    want = wanted(ctx, upstream_map, accepted, maps)
    yield Decision("generation", produces=GATEWAY_GENERATION, value=want.generation)
    env = File("gateway environment", path=GATEWAY_ENV_FILE, content=f"GATEWAY_KEY={key}\n", mode="0600", secret=True,
               current=ctx.facts.get("gateway_env"))
    yield env
    # the usage service first: HAProxy sends it each request's record from its start
    yield from usage_steps.service_steps(ctx)
    shared = shared_address(ctx.vars)
    yield from proxy.steps(ctx, GATEWAY, "gateway", want, GATEWAY_ENV_FILE, env_changed=env.content_changed(),
                           extra_files=(upstream_keys_file(ctx, upstream_map), *maps),
                           handoff=proxy.Handoff(shared, GATEWAY.port(ctx.vars), SHARED_ADDRESS_UNIT) if shared else None)


def generation_inputs(ctx):
    """(the upstream keys' map, the accepted keys, the files besides the key lists that the
    generation counts: the keys' names and limits, the peer certificate and CA), read on the
    control machine: what a deploy and a keys run both count, so that neither makes the
    other's configuration stale (a reload for nothing). None, after a failed Check naming
    what could not be read."""
    try:
        upstream_map = upstream_keys(ctx)
    except SecretError as exc:
        yield Check("model_fallback", ok=False, message=str(exc))
        return None
    try:
        accepted, maps = keys_and_limits(ctx)
    except CredentialError as exc:
        yield Check("keys", ok=False, message=str(exc))
        return None
    # the guard of its health checks: HAProxy loads it, so a change is a reload and a new generation too
    maps += (File("gateway health checks' guard (Lua)", path=f"{GATEWAY.dir}/{LIVE_ANSWERS}", content=live_answers(),
                  mode="0644", current=ctx.facts.get("gateway_live_answers")),)
    try:
        maps += peer_files(ctx)  # read as the maps are: a change is a reload, and a new generation
    except CredentialError as exc:
        yield Check("peer certificate", ok=False, message=f"{ctx.name}: {exc}")
        return None
    return upstream_map, accepted, maps


def plan_keys(ctx):
    read = yield from generation_inputs(ctx)
    if read is None:
        return
    upstream_map, accepted, maps = read
    yield from proxy.reload_steps(ctx, GATEWAY, "gateway", wanted(ctx, upstream_map, accepted, maps),
                                  extra_files=(upstream_keys_file(ctx, upstream_map), *maps))


def summary(ctx) -> dict:
    out = proxy.summary(ctx, GATEWAY, "gateway", GATEWAY_GENERATION)
    fleet = ctx.services.get("fleet")
    if out and fleet:
        out["gateway"]["servers"] = [door.host for door in fleet.serving]
        out["gateway"]["pools"] = {family: [door.host for door in serving(fleet, family)]
                                   for family in fleet_families(fleet)}
    if out:  # the usage service that counts what the gateway answers (roles/gateway/tests)
        out["gateway"]["usage"] = {"unit": accounting.UNIT, "socket": accounting.SOCKET}
    return out


ROLE = Role("gateway", facts, plan, summary=summary, hosts=is_gateway)
KEYS_ROLE = Role("gateway keys", keys_facts, plan_keys, hosts=is_gateway)
