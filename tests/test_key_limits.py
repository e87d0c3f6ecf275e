"""A key's limits as declared (serving/key_limits.py, the key store, `invoke keys.add` and
`keys.set`): checked like the inventory, each error naming the limit; a key's own limits over
the inventory's key_limits; what HAProxy reads of them (keys.map, limits.map, no secret); the
front doors behind gateways take only keys that nothing limits."""
import json
import os
import subprocess
import sys

import pytest

from credentials import CredentialError
from credentials.keys import KeyStore, digest
from serving import key_limits as limits
from tests.conftest import ROOT


def test_a_wrong_limit_is_named_with_what_is_wrong():
    assert limits.problems({"requests_per_minute": 60, "models": ["diffusiongemma"]}, "x") == []
    wrong = limits.problems({"requests_per_minute": -1, "models": ["Bad Name"], "tokens_per_day": 5_000_000_000,
                             "colour": "red"}, "keys.json: bob.limits")
    text = "\n".join(wrong)
    assert "keys.json: bob.limits.requests_per_minute: -1 is less than the minimum of 0" in text
    assert "bob.limits.models.0" in text and "bob.limits.tokens_per_day" in text and "'colour'" in text
    assert limits.problems({"expires": "2026-13-40"}, "k") == ["k.expires: '2026-13-40' is not a date (month must be in 1..12)"]


def test_a_keys_own_limits_over_the_inventorys_and_what_haproxy_reads():
    defaults = {"requests_per_minute": 30, "tokens_per_day": 1000}
    mine = limits.effective(defaults, {"requests_per_minute": 60, "models": ["gemma4"], "expires": "2027-01-01"})
    assert (mine.requests_per_minute, mine.tokens_per_day, mine.models, mine.upstream) == (60, 1000, ("gemma4",), False)
    assert mine.expires == 1798761600 and mine.limited
    assert mine.word() == "60:0:1000:1798761600:,gemma4,:0:0:0:0"
    assert limits.effective(None, None) == limits.Limits() and not limits.Limits(upstream=True).limited
    assert limits.UNLIMITED.word() == "0:0:0:0:*:1:0:0:0"
    # a front end's cap over all its users: in the word only for a front end, refused for a key that is none
    crowd = limits.effective(None, {"front_end": True, "all_users_requests_per_minute": 200,
                                    "all_users_tokens_per_day": 10**6})
    assert crowd.word() == "0:0:0:0:*:0:1:200:1000000" and crowd.limited and "200/min over all users" in crowd.shown()
    assert limits.effective(None, {"all_users_requests_per_minute": 200}).word().endswith(":0:0:0")
    assert limits.problems({"front_end": False, "all_users_tokens_per_day": 5}, "k") == [
        "k.all_users_tokens_per_day: a cap over all of a key's users is a front end's: not with front_end false"]
    assert "60/min" in mine.shown() and "expires 2027-01-01 00:00 UTC" in mine.shown()
    text = limits.keys_map({"alice": digest("dgk-secret")}) + limits.limits_map({"alice": mine})
    assert "dgk-secret" not in text and f"{digest('dgk-secret')} alice\n" in text and "alice 60:0:1000:" in text


def test_behind_gateways_the_front_doors_take_only_the_keys_nothing_limits():
    hashes = {"api_key_file": "a", "alice": "b", "bob": "c", "webui": "d"}
    own = {"alice": {"requests_per_minute": 5}, "webui": {"front_end": True, "upstream": True}}
    assert limits.unlimited_only(hashes, own, {}) == {"api_key_file": "a", "bob": "c", "webui": "d"}
    # the inventory limiting every key: only its own key (the operator's) is left to the front doors
    assert limits.unlimited_only(hashes, own, {"tokens_per_day": 10}) == {"api_key_file": "a"}


def test_the_key_store_keeps_a_keys_limits_and_changes_them(tmp_path):
    store = KeyStore(tmp_path)
    store.add("alice", {"requests_per_minute": 60})
    store.add("bob")
    assert store.limits() == {"alice": {"requests_per_minute": 60}, "bob": {}}
    assert store.set_limits("alice", {"tokens_per_day": 500}) == {"requests_per_minute": 60, "tokens_per_day": 500}
    assert store.set_limits("alice", {}, cleared=("requests_per_minute",)) == {"tokens_per_day": 500}
    assert store.set_limits("alice", {}, cleared=("tokens_per_day",)) == {}
    assert "limits" not in json.loads((tmp_path / "keys.json").read_text())["alice"]
    with pytest.raises(CredentialError, match="no key named carol .*alice, bob"):
        store.set_limits("carol", {"requests_per_minute": 1})


def _invoke(*args, inventory):
    env = {**os.environ, "DGEMMA_INVENTORY": str(inventory)}
    return subprocess.run([sys.executable, "-m", "invoke", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _inventory(tmp_path, gateway: bool):
    inventory = tmp_path / "inventory"
    inventory.mkdir(parents=True)
    hosts = {"all": {"vars": {"credentials_dir": str(tmp_path / "credentials")},
                     "children": {"rtx": {"hosts": {"rtx01": {"ansible_host": "127.0.0.1"}}}}}}
    if gateway:
        hosts["all"]["children"]["gateway"] = {"hosts": {"gateway01": {"ansible_host": "127.0.0.2"}}}
    (inventory / "hosts.yml").write_text(json.dumps(hosts))
    return inventory


@pytest.mark.parametrize("args, said", [
    (["--requests-per-minute", "sixty"], "--requests-per-minute sixty: expected a whole number"),
    (["--models", "diffusiongemma,llama"], "--models diffusiongemma,llama: llama is no model family"),
    (["--upstream", "maybe"], "--upstream maybe: expected yes or no"),
    (["--expires", "tomorrow"], "--expires: 'tomorrow' does not match"),
    (["--tokens-per-day", "9000000000"], "--tokens-per-day: 9000000000 is greater than the maximum of 4000000000"),
    # a cap over all of a key's users on a key that is no front end would limit nothing
    (["--all-users-requests-per-minute", "30"], "--all-users-requests-per-minute 30: a cap over all of a key's "
                                                "users means something for a front end alone, and bob is not one"),
    (["--all-users-tokens-per-day", "900", "--front-end", "no"], "--all-users-tokens-per-day"),
])
def test_keys_add_refuses_a_wrong_limit_naming_the_option_and_makes_no_key(tmp_path, args, said):
    inventory = _inventory(tmp_path, gateway=True)
    proc = _invoke("keys.add", "bob", *args, inventory=inventory)
    assert proc.returncode == 2 and said in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "credentials" / "keys.json").exists()


def test_a_cap_over_all_users_goes_with_a_front_end_in_add_and_in_set(tmp_path):
    """keys.add with --front-end yes takes it; keys.set may not take away front_end from under a cap
    (--clear front_end, or --front-end no), nor give a cap to a key that is no front end; where the
    inventory's key_limits make every key a front end, the cap alone is taken."""
    inventory = _inventory(tmp_path, gateway=True)
    made = _invoke("keys.add", "owui", "--front-end", "yes", "--all-users-requests-per-minute", "30",
                   inventory=inventory)
    assert made.returncode in (0, 1) and "Traceback" not in made.stderr, made.stderr  # 1: no front door to reload
    stored = json.loads((tmp_path / "credentials" / "keys.json").read_text())
    assert stored["owui"]["limits"] == {"front_end": True, "all_users_requests_per_minute": 30}
    for args in (["--clear", "front_end"], ["--front-end", "no"]):
        proc = _invoke("keys.set", "owui", *args, inventory=inventory)
        assert proc.returncode == 2 and "its all_users_requests_per_minute: a cap over all of a key's users" \
            in proc.stderr, proc.stderr
    plain = _invoke("keys.add", "bob", "--requests-per-minute", "5", inventory=inventory)
    assert plain.returncode in (0, 1), plain.stderr
    proc = _invoke("keys.set", "bob", "--all-users-tokens-per-day", "500", inventory=inventory)
    assert proc.returncode == 2 and "--all-users-tokens-per-day 500: a cap" in proc.stderr, proc.stderr
    assert json.loads((tmp_path / "credentials" / "keys.json").read_text())["bob"]["limits"] == \
        {"requests_per_minute": 5}
    (inventory / "group_vars").mkdir()
    (inventory / "group_vars" / "all.yml").write_text("key_limits: {front_end: true}\n")
    proc = _invoke("keys.add", "carol", "--all-users-requests-per-minute", "10", inventory=inventory)
    assert "a cap over all" not in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_limits_without_a_gateway_are_refused_and_set_needs_a_change(tmp_path):
    proc = _invoke("keys.add", "bob", "--requests-per-minute", "5", inventory=_inventory(tmp_path, gateway=False))
    assert proc.returncode == 2 and "enforced by the gateways, and this inventory has none" in proc.stderr
    proc = _invoke("keys.set", "bob", inventory=_inventory(tmp_path / "g", gateway=True))
    assert proc.returncode == 2 and "nothing to change" in proc.stderr


def test_a_users_key_never_takes_the_place_of_one_of_the_fleets_own(tmp_path):
    """keys.add gateway (or monitoring, or api_key_file) is refused; a keys.json that holds such a
    name from before is not taken in its place: the front doors keep taking the gateway's key, and
    the operator's stays the one unlimited."""
    from credentials.keys import RESERVED
    from serving.key_limits import OPERATOR
    from serving.haproxy import tls
    assert {tls.GATEWAY_KEY, tls.MONITORING_KEY, OPERATOR} <= RESERVED
    store = KeyStore(tmp_path)
    for name in sorted(RESERVED):
        with pytest.raises(CredentialError, match=f"key name '{name}' is the fleet's own"):
            store.add(name)
    assert not (tmp_path / "keys.json").exists() or store.hashes() == {}
    # as if added before the refusal: the store says gateway and api_key_file are users' keys
    store.add("alice")
    data = json.loads((tmp_path / "keys.json").read_text())
    data["gateway"] = data["api_key_file"] = {"sha256": "0" * 64, "added": "2026-11-01T00:00:00+00:00"}
    (tmp_path / "keys.json").write_text(json.dumps(data))
    operator = tmp_path / "operator.key"
    operator.write_text("dgk-operator\n")
    operator.chmod(0o600)
    v = {"credentials_dir": str(tmp_path), "api_key_file": str(operator)}
    accepted = tls.accepted_keys("rtx01", v, gateway=True, make=True)
    assert accepted["gateway"] == digest((tmp_path / "gateway.key").read_text().strip())
    assert accepted["api_key_file"] == digest("dgk-operator") and "0" * 64 not in accepted.values()
