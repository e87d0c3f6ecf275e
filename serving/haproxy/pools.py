"""Pools: the servers of one model family behind a front door or the gateway, the model
names routed to each, and each pool's fallback (``model_fallback``). Pure.

A request goes to the pool of the model it names (an alias, or a variant's id); one that
names none goes to the first pool (DiffusionGemma where it is served), as vLLM takes its
own model then; one that names a model no pool serves gets vLLM's 404."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from serving import catalog
from serving.declared import DEFAULT_FAMILY, declared, served_name, served_names
from serving.declared import Refused



@dataclass(frozen=True)
class Pool:
    name: str  # the family
    names: tuple  # the model names routed to it: its aliases, then the catalog's ids of its variants
    servers: tuple  # render.Server
    fallback: dict | None = None  # the gateway's: {"to", "servers"} or {"url", "address", ...}
    # a front door's, when the family falls back on a queue (after_queued_s): {"limit": requests
    # each replica takes at once, "after_s": how long the queue may be busy before /health says full}
    queue: dict | None = None
    # a front door's: the sampling parameters the family takes and does not apply (the catalog's
    # ignored_parameters), named on the answer (X-Dgemma-Ignored-Parameters) or, refuse, a 400
    ignored: tuple = ()
    refuse_ignored: bool = False


def default_first(families) -> list[str]:
    """Families in pool order: DiffusionGemma first where it is one (the pool of a request that
    names no model), then as given."""
    return sorted(dict.fromkeys(families), key=lambda f: f != DEFAULT_FAMILY)


def families_of(door) -> list[str]:
    """The families a serving host declares (``models:``), as the inventory says; a
    declaration preflight refuses counts as the default (that host fails its own preflight)."""
    try:
        return [e.family for e in declared(door.models)]
    except (Refused, KeyError):
        return ["diffusiongemma"]


def fleet_families(fleet) -> list[str]:
    """Every family the fleet serves, DiffusionGemma first when it is one (the pool of a
    request that names no model), then in inventory order."""
    return default_first(f for door in fleet.serving for f in families_of(door))


def serving(fleet, family: str) -> list:
    return [door for door in fleet.serving if family in families_of(door)]


def aliases(fleet, family: str) -> list[str]:
    """The names a family is asked for by, across the fleet (its alias on each host)."""
    return list(dict.fromkeys(served_name(family, door.models) for door in serving(fleet, family)))


def answers(door, family: str) -> list[str]:
    """Every name a family's replicas answer to on that host (its fallbacks' too)."""
    return served_names(family, door.models)


def model_names(family: str, aliases) -> tuple:
    ids = [m for m, spec in catalog.models()["variants"].items() if spec["family"] == family]
    return tuple(dict.fromkeys([*aliases, *ids]))


def frontdoor_pools(families: dict[str, str], aliases: dict[str, str], servers: list) -> list[Pool]:
    """``families``: a replica's server name -> its family; ``aliases``: family -> its alias on
    this host; ``servers``: the replicas' servers (render.Server), in order."""
    order = default_first(families.values())
    return [Pool(f, model_names(f, [aliases.get(f, f)]),
                 tuple(s for s in servers if families.get(s.name) == f)) for f in order]


def queue_rule(v: dict, family: str) -> dict | None:
    """The front door's queue for ``family``: each replica takes max_num_seqs requests at once
    (its models: entry's, else the host's), when ``model_fallback`` falls back on a queue."""
    after = ((v.get("model_fallback") or {}).get(family) or {}).get("after_queued_s")
    if not after:
        return None
    try:
        entry = next((e for e in declared(v) if e.family == family), None)
    except Refused:
        entry = None
    limit = (entry.settings if entry else {}).get("max_num_seqs", v.get("max_num_seqs", 4))
    return {"limit": int(limit), "after_s": int(after)}


def pools_in_config(text: str) -> dict[str, str]:
    """A server's name -> its family, as a front door's running configuration groups them (a
    run that places nothing, e.g. keys add, renders them as they are)."""
    found, pool = {}, None
    for line in text.splitlines():
        head = re.match(r"backend pool_([a-z][a-z0-9_]*)\s*$", line)
        if head or line.startswith(("backend ", "frontend ", "global", "defaults")):
            pool = head.group(1) if head else None
            continue
        server = re.match(r"\s+server (\S+) ", line)
        if pool and server:
            found[server.group(1)] = pool
    return found


def upstream(spec: dict) -> dict:
    """An external OpenAI-compatible upstream as HAProxy reaches it: its address, TLS, Host
    header and the path its API sits under (``url`` ends in /v1, or at the API's base)."""
    url = urlsplit(spec["url"])
    tls = url.scheme == "https"
    port = url.port or (443 if tls else 80)
    host = url.hostname
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    # a name DNS cannot resolve at start must not keep the gateway down: resolved when it can be
    options = " init-addr libc,none" + (
        f" ssl verify required ca-file @system-ca sni str({host}) check-sni {host}" if tls else "")
    return {"url": spec["url"], "address": address, "options": options, "host": url.netloc,
            "prefix": url.path.rstrip("/") or "/v1"}


UPSTREAM_KEYS = "upstream-keys.map"  # in the gateway's folder, 0600: each family's upstream key


def render_upstream_keys(keys: dict[str, str]) -> str:
    """HAProxy's map of each family's external upstream key (``keys``: family to key). A
    file, not the environment: a new key, or a new upstream, is then a reload (the listening
    sockets stay open), where an environment change is a restart."""
    return "# Managed by dgemma-fleet: each family's external fallback key (0600, gateways only)\n" + "".join(
        f"{family} {key}\n" for family, key in sorted(keys.items()))


def gateway_pools(fleet, servers_of, policy: dict | None) -> list[Pool]:
    """The gateway's pools: each family of the fleet over the front doors that serve it
    (``servers_of(doors)``: their servers), with its fallback from ``policy`` (model_fallback)."""
    policy = policy or {}
    families = fleet_families(fleet)
    base = {f: servers_of(serving(fleet, f)) for f in families}
    pools = []
    for family in families:
        rule = policy.get(family)
        fallback = None
        if rule and rule.get("to") in base:
            fallback = {"to": rule["to"], "servers": tuple(base[rule["to"]])}
        elif rule and rule.get("url"):
            fallback = upstream(rule)
        pools.append(Pool(family, model_names(family, aliases(fleet, family)), tuple(base[family]), fallback))
    return pools


def models_list(pools: list[Pool]) -> str | None:
    """/v1/models for several pools, as vLLM writes it: each family's alias (None for one pool:
    its replicas answer /v1/models themselves)."""
    if len(pools) < 2:
        return None
    data = [{"id": pool.names[0], "object": "model", "created": 0, "owned_by": "vllm", "root": pool.names[0],
             "parent": None} for pool in pools]
    return json.dumps({"object": "list", "data": data}, separators=(",", ":"))
