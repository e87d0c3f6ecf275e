"""The users' keys: keys.add, keys.revoke, keys.list."""
from __future__ import annotations

import sys

from invoke import Collection, Exit, task

from . import runs


def _keys_reload(c, inventory, hosts, ask_become_pass):
    """Every front door takes the new key list (a reload; vLLM keeps running)."""
    from roles.frontdoor.role import KEYS_ROLE
    from roles.gateway.role import KEYS_ROLE as GATEWAY_KEYS_ROLE
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    report = runs.run(play, [KEYS_ROLE, GATEWAY_KEYS_ROLE], hosts, None, title="KEYS RECAP")
    return report


def _key_store(inventory):
    from credentials import directory
    from credentials.keys import KeyStore
    play = runs.load_play(inventory)
    return KeyStore(directory(play.hostvars(play.inventory.host_names[0]) if play.inventory.host_names else None))


KEYS_HELP = {"inventory": runs.HELP["inventory"], "hosts": "front doors and gateways to reload (default: all)",
             "ask_become_pass": runs.HELP["ask_become_pass"]}


@task(klass=runs.HostTask, help={**KEYS_HELP, "name": "whose key (letters, digits, . _ @ -)"})
def keys_add(c, name, inventory=None, hosts=None, ask_become_pass=False):
    """Make a key for NAME, reload the front doors, and print the key once (last line of stdout)."""
    from credentials import CredentialError
    if name.startswith("-"):
        raise Exit(f"{name}: expected a key's name; usage: invoke keys.add NAME (help: invoke --help keys.add)",
                   code=2)
    try:
        secret = _key_store(inventory).add(name)
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


@task(klass=runs.HostTask, help={**KEYS_HELP, "name": "whose key"})
def keys_revoke(c, name, inventory=None, hosts=None, ask_become_pass=False):
    """Forget NAME's key and reload the front doors: it is refused (401) when this returns."""
    from credentials import CredentialError
    try:
        _key_store(inventory).revoke(name)
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    report = _keys_reload(c, inventory, hosts, ask_become_pass)
    if report.failed:
        raise Exit(code=1)


@task(help={"inventory": runs.HELP["inventory"]})
def keys_list(c, inventory=None):
    """The keys' names, when they were made, and the start of their sha256 (never a key)."""
    from credentials import CredentialError
    try:
        store = _key_store(inventory)
        data = store.load()
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    if not data:
        print(f"no keys in {store.path}: invoke keys.add NAME")
    for name, entry in sorted(data.items()):
        print(f"{name:<24} added {entry.get('added', '?'):<26} sha256 {entry['sha256'][:12]}…")


ns = Collection("keys")
ns.add_task(keys_add, name="add")
ns.add_task(keys_revoke, name="revoke")
ns.add_task(keys_list, name="list")
