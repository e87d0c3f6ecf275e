"""gateway: on the hosts of the inventory group `gateway`, one address for the
whole fleet: the front door's HAProxy (TLS, keys, allowlist), balancing over every
serving host's front door over TLS checked against the fleet CA.

It takes a server out within about two seconds of failing /health (checks every
second, two failures) and back after two good ones; a request that reached no
server, or got no answer at all (a link cut mid-request is found by TCP
keepalives), is tried on another one, so a host going down costs no failed
non-streaming request. It reaches the front doors with a key of its own, which
only this host holds (in a 0600 environment file)."""
from __future__ import annotations

from converge.changes import Check, File, Role
from converge.facts.host import FileState
from credentials import CredentialError, directory
from credentials.keys import service_key

from roles.fleet import is_gateway
from roles.frontdoor import proxy, tls
from roles.frontdoor.render import CONTAINER_DIR, GATEWAY, Server

ENV_FILE = "/etc/dgemma/gateway.env"
# checks every second, a server out after two failures; connects give up after a second
BACKEND = {"connect_timeout": "1s", "check_timeout": "2s", "inter": "1s", "tcp_keepalive": True}


def facts(v):
    return {**proxy.facts(v, GATEWAY, "gateway"), "gateway_env": FileState(ENV_FILE, secret=True)}


def servers(fleet) -> list[Server]:
    out = []
    for door in fleet.serving:
        address = f"[{door.address}]" if ":" in door.address else door.address
        # the front door's certificate names the host's inventory name: checked, and sent as SNI
        out.append(Server(door.host, f"{address}:{door.port}",
                          f" ssl verify required ca-file {CONTAINER_DIR}/ca.crt verifyhost {door.host} "
                          f"sni str({door.host}) check-sni {door.host}"))
    return out


def wanted(ctx) -> proxy.Wanted:
    fleet = ctx.services.get("fleet")
    # front doors with a certificate of their own: the gateway trusts their CAs too
    own_cas = tuple(dict.fromkeys(door.ca_file for door in fleet.serving if door.ca_file))
    return proxy.wanted(ctx, GATEWAY, servers(fleet), tls.accepted_keys(ctx.name, ctx.vars), BACKEND, own_cas)


def plan(ctx):
    fleet = ctx.services.get("fleet")
    if fleet is None or not fleet.serving:
        yield Check("serving hosts", ok=False, message="the inventory has no serving host for the gateway to "
                                                       "front: add hosts outside the group `gateway`")
        return
    try:
        key = service_key(directory(ctx.vars), tls.GATEWAY_KEY)
    except CredentialError as exc:
        yield Check("gateway key", ok=False, message=str(exc))
        return
    want = wanted(ctx)
    ctx.desired["gateway_generation"] = want.generation
    env = File("gateway environment", path=ENV_FILE, content=f"GATEWAY_KEY={key}\n", mode="0600", secret=True,
               current=ctx.facts.get("gateway_env"))
    yield env
    yield from proxy.steps(ctx, GATEWAY, "gateway", want, ENV_FILE, env_changed=env.content_changed())


def plan_keys(ctx):
    yield from proxy.reload_steps(ctx, GATEWAY, "gateway", wanted(ctx))


def summary(ctx) -> dict:
    out = proxy.summary(ctx, GATEWAY, "gateway")
    fleet = ctx.services.get("fleet")
    if out and fleet:
        out["gateway"]["servers"] = [door.host for door in fleet.serving]
    return out


ROLE = Role("gateway", facts, plan, summary=summary, hosts=is_gateway)
KEYS_ROLE = Role("gateway keys", facts, plan_keys, hosts=is_gateway)
