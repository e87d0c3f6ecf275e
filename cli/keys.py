"""The users' keys: keys.add, keys.set, keys.revoke, keys.list."""
from __future__ import annotations

import sys

from invoke import Collection, Exit, task

from . import runs


def _keys_reload(c, inventory, hosts, ask_become_pass):
    """Every front door and gateway takes the new key list and limits (a reload; vLLM keeps running)."""
    from roles.frontdoor.role import KEYS_ROLE
    from roles.gateway.role import KEYS_ROLE as GATEWAY_KEYS_ROLE
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    report = runs.run(play, [KEYS_ROLE, GATEWAY_KEYS_ROLE], hosts, None, title="KEYS RECAP")
    return report


def _play_and_store(inventory):
    from credentials import directory
    from credentials.keys import KeyStore
    play = runs.load_play(inventory)
    any_host = play.hostvars(play.inventory.host_names[0]) if play.inventory.host_names else None
    return play, KeyStore(directory(any_host)), any_host or {}


KEYS_HELP = {"inventory": runs.HELP["inventory"], "hosts": "front doors and gateways to reload (default: all)",
             "ask_become_pass": runs.HELP["ask_become_pass"]}
LIMITS_HELP = {
    "requests_per_minute": "requests a minute (a fixed window, each minute of the clock; 0: none)",
    "requests_at_once": "requests in flight at once (0: none)",
    "tokens_per_day": "prompt and completion tokens a day, UTC, from vLLM's usage (0: none)",
    "models": "the model families it may ask for, comma-separated (e.g. diffusiongemma; 'all': every one)",
    "upstream": "yes or no: whether it may spend on an external upstream (a family's fallback to a hosted API)",
    "expires": "when it stops working: a UTC date (YYYY-MM-DD) or date and time (YYYY-MM-DDTHH:MM); 'never'",
    "front_end": "yes or no: a front end many people use (Open WebUI forwarding its users): limits per end user",
    "all_users_requests_per_minute": "a front end's requests a minute over all its users together (0: none)",
    "all_users_tokens_per_day": "a front end's tokens a day over all its users together (0: none)",
}


def _meant_for_a_front_end(name: str, own: dict, cleared: list, stored: dict, defaults: dict):
    """A cap over all of a key's users (--all-users-*) means something for a front end alone: on a
    key that will not be one (its own front_end, else the inventory's key_limits), it is refused,
    as it would limit nothing (a key made so answered 80 of 80 requests sent at once)."""
    from serving.key_limits import ALL_USERS
    kept = {k: v for k, v in (stored or {}).items() if k not in cleared}
    merged = {**(defaults or {}), **kept, **own}
    caps = [field for field in ALL_USERS if merged.get(field)]
    if caps and not merged.get("front_end"):
        given = [f"--{field.replace('_', '-')} {own[field]}" for field in caps if field in own]
        what = " and ".join(given) or f"its {' and '.join(caps)}"
        raise Exit(f"{what}: a cap over all of a key's users means something for a front end alone, and {name} "
                   f"is not one (front_end is false for it): add --front-end yes if {name} is a front end many "
                   f"people use (Open WebUI), or give the key's own limit (--requests-per-minute, "
                   f"--tokens-per-day)", code=2)


def _own_limits(play, requests_per_minute, requests_at_once, tokens_per_day, models, upstream, expires,
                front_end, all_users_requests_per_minute=None, all_users_tokens_per_day=None) -> tuple[dict, list]:
    """The limits the options give (and the ones they put back to the inventory's), checked as the
    inventory's key_limits are: a wrong one exits 2 naming the option."""
    from serving.key_limits import problem_pairs
    from serving.replicas import families
    own, cleared = {}, []
    for option, value in (("requests_per_minute", requests_per_minute), ("requests_at_once", requests_at_once),
                          ("tokens_per_day", tokens_per_day),
                          ("all_users_requests_per_minute", all_users_requests_per_minute),
                          ("all_users_tokens_per_day", all_users_tokens_per_day)):
        if value is not None:
            if not str(value).isdigit():
                raise Exit(f"--{option.replace('_', '-')} {value}: expected a whole number (0: none)", code=2)
            own[option] = int(value)
    if models is not None:
        if models.strip() == "all":
            cleared.append("models")
        else:
            own["models"] = [m.strip() for m in models.split(",") if m.strip()]
            unknown = [m for m in own["models"] if m not in families()]
            if unknown:
                raise Exit(f"--models {models}: {', '.join(unknown)} is no model family of the catalog (it has "
                           f"{', '.join(families())})", code=2)
    for option, value in (("upstream", upstream), ("front_end", front_end)):
        if value is not None:
            if value not in ("yes", "no"):
                raise Exit(f"--{option.replace('_', '-')} {value}: expected yes or no", code=2)
            own[option] = value == "yes"
    if expires is not None:
        if expires == "never":
            cleared.append("expires")
        else:
            own["expires"] = expires
    found = problem_pairs(own)
    if found:
        raise Exit("\n".join(f"--{field.split('.')[0].replace('_', '-')}: {message}" for field, message in found),
                   code=2)
    if own and not [h for h in play.inventory.host_names if "gateway" in play.hostvars(h).get("group_names", [])]:
        raise Exit("a key's limits are enforced by the gateways, and this inventory has none (the group gateway): "
                   "add one, or make the key without limits", code=2)
    return own, cleared


@task(klass=runs.HostTask, help={**KEYS_HELP, **LIMITS_HELP, "name": "whose key (letters, digits, . _ @ -)"})
def keys_add(c, name, inventory=None, hosts=None, ask_become_pass=False, requests_per_minute=None,
             requests_at_once=None, tokens_per_day=None, models=None, upstream=None, expires=None, front_end=None,
             all_users_requests_per_minute=None, all_users_tokens_per_day=None):
    """Make a key for NAME (its limits over the inventory's key_limits), reload the front doors and
    gateways, and print the key once (last line of stdout)."""
    from credentials import CredentialError
    if name.startswith("-"):
        raise Exit(f"{name}: expected a key's name; usage: invoke keys.add NAME (help: invoke --help keys.add)",
                   code=2)
    play, store, v = _play_and_store(inventory)
    own, _ = _own_limits(play, requests_per_minute, requests_at_once, tokens_per_day, models, upstream,
                         expires, front_end, all_users_requests_per_minute, all_users_tokens_per_day)
    _meant_for_a_front_end(name, own, [], {}, v.get("key_limits"))
    try:
        secret = store.add(name, own)
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    report = _keys_reload(c, inventory, hosts, ask_become_pass)
    if report.failed:
        print("the key is stored; the front doors above that failed still refuse it until they take it "
              "(invoke deploy, or invoke keys.add again after invoke keys.revoke)", file=sys.stderr)
    # alone on the last line of stdout: the one time it is shown; only its sha256 is kept
    print(secret, flush=True)
    if report.failed:
        raise Exit(code=1)


@task(klass=runs.HostTask, help={**KEYS_HELP, **LIMITS_HELP, "name": "whose key",
                                 "clear": "limits to put back to the inventory's key_limits, comma-separated"})
def keys_set(c, name, inventory=None, hosts=None, ask_become_pass=False, requests_per_minute=None,
             requests_at_once=None, tokens_per_day=None, models=None, upstream=None, expires=None, front_end=None,
             clear=None, all_users_requests_per_minute=None, all_users_tokens_per_day=None):
    """Change NAME's limits and reload the gateways (its counts so far are kept)."""
    from credentials import CredentialError
    from serving.key_limits import FIELDS
    play, store, v = _play_and_store(inventory)
    own, cleared = _own_limits(play, requests_per_minute, requests_at_once, tokens_per_day, models, upstream,
                               expires, front_end, all_users_requests_per_minute, all_users_tokens_per_day)
    for limit in (clear or "").split(","):
        limit = limit.strip().replace("-", "_")
        if limit:
            if limit not in FIELDS:
                raise Exit(f"--clear {clear}: {limit} is none of {', '.join(FIELDS)}", code=2)
            cleared.append(limit)
    if not own and not cleared:
        raise Exit("keys.set: nothing to change; give a limit (invoke --help keys.set)", code=2)
    try:
        stored = (store.load().get(name) or {}).get("limits") or {}
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    _meant_for_a_front_end(name, own, cleared, stored, v.get("key_limits"))
    try:
        store.set_limits(name, own, cleared)
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    report = _keys_reload(c, inventory, hosts, ask_become_pass)
    if report.failed:
        raise Exit(code=1)


@task(klass=runs.HostTask, help={**KEYS_HELP, "name": "whose key; several, comma-separated: all revoked at once "
                                                      "(one reload), or none if one is not there"})
def keys_revoke(c, name, inventory=None, hosts=None, ask_become_pass=False):
    """Forget NAME's key and reload the front doors: it is refused (401) when this returns."""
    from credentials import CredentialError
    names = [n.strip() for n in name.split(",") if n.strip()]
    if not names:
        raise Exit(f"keys.revoke {name!r}: name a key (invoke keys.list shows them)", code=2)
    _, store, _ = _play_and_store(inventory)
    try:
        store.revoke(*names)
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    report = _keys_reload(c, inventory, hosts, ask_become_pass)
    if report.failed:
        raise Exit(code=1)


@task(help={"inventory": runs.HELP["inventory"]})
def keys_list(c, inventory=None):
    """The keys' names, when they were made, the start of their sha256 (never a key) and their limits."""
    from credentials import CredentialError
    from serving.key_limits import effective
    try:
        _, store, v = _play_and_store(inventory)
        data = store.load()
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    if not data:
        print(f"no keys in {store.path}: invoke keys.add NAME")
    for name, entry in sorted(data.items()):
        limits = effective(v.get("key_limits"), entry.get("limits"))
        print(f"{name:<24} added {entry.get('added', '?'):<26} sha256 {entry['sha256'][:12]}…  {limits.shown()}")


ns = Collection("keys")
ns.add_task(keys_add, name="add")
ns.add_task(keys_set, name="set")
ns.add_task(keys_revoke, name="revoke")
ns.add_task(keys_list, name="list")
