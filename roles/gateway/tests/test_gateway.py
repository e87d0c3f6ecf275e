"""The gateway as deployed: running, its current configuration answering, the
allowlist and keys as at a front door, and every serving host in it and UP."""
import csv
import io

import pytest


@pytest.fixture
def gateway(expected):
    return expected["gateway"]


@pytest.fixture
def https(https_to, gateway):
    return https_to(gateway)


def test_gateway_runs_and_starts_at_boot(host, gateway, fix):
    unit = host.service(gateway["unit"])
    assert unit.is_running, f"{gateway['unit']} is not running; {fix} (or see: journalctl -u {gateway['unit']})"
    assert unit.is_enabled, f"{gateway['unit']} is not enabled at boot; {fix}"


def test_the_usage_service_counts_and_starts_at_boot(host, gateway, fix):
    """What the gateway answers is counted there (keys' limits, invoke usage): without it every
    key with limits gets 503 counts_loading. Its socket is in /run, made anew at every boot."""
    usage = gateway["usage"]
    unit = host.service(usage["unit"])
    assert unit.is_running, f"{usage['unit']} is not running; {fix} (or see: journalctl -u {usage['unit']})"
    assert unit.is_enabled, f"{usage['unit']} is not enabled at boot; {fix}"
    assert host.file(usage["socket"]).is_socket, \
        f"{usage['socket']} is not there: the usage service takes no records; see: journalctl -u {usage['unit']}"


def test_gateway_answers_with_its_current_configuration(https, gateway, fix):
    status, headers, err = https("/health")
    assert status == 200, f"https /health answered {status or err.strip()}: no serving host is UP; {fix}"
    assert headers.get("x-frontdoor-generation") == gateway["generation"], \
        f"the gateway answers with another configuration: it was not reloaded; {fix}"


def test_only_the_allowlist_goes_through_and_a_key_is_asked(https, fix):
    assert https("/v1/models")[0] == 401, f"/v1/models answers without a key; {fix}"
    for path in ("/invocations", "/metrics", "/tokenize"):
        assert https(path, "POST")[0] == 404, f"{path} is reachable through the gateway; {fix}"


def test_every_serving_host_is_in_the_gateway_and_up(host, gateway, fix):
    out = host.run("curl -sS --max-time 5 'http://127.0.0.1:8405/stats;csv'")
    rows = [r for r in csv.DictReader(io.StringIO(out.stdout.lstrip("# "))) if r["pxname"].startswith("pool_")
            and r["svname"] not in ("FRONTEND", "BACKEND")]
    # each pool (a model family) over the front doors that serve it
    pools = {}
    for r in rows:
        pools.setdefault(r["pxname"].removeprefix("pool_"), []).append(r["svname"])
    assert pools == gateway["pools"], f"the gateway has {pools}, the inventory says {gateway['pools']}; {fix}"
    states = {f"{r['svname']} ({r['pxname'].removeprefix('pool_')})": r["status"] for r in rows}
    down = {s: st for s, st in states.items() if st != "UP"}
    assert not down, f"not UP in the gateway: {down}; see: invoke status"


def test_the_gateways_secrets_are_0600(host, gateway, fix):
    for path in (f"{gateway['dir']}/tls.pem", f"{gateway['dir']}/keys.sha256", "/etc/dgemma/gateway.env",
                 f"{gateway['dir']}/upstream-keys.map"):
        f = host.file(path)
        assert f.exists and f.mode == 0o600 and f.user == "root", f"{path}: mode {oct(f.mode)}; {fix}"
