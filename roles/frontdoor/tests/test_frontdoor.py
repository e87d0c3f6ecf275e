"""The front door as deployed: running, the fleet CA's certificate for this host's
name, its current configuration answering, only the allowlist through, a key asked."""

import pytest


@pytest.fixture
def door(expected):
    if not expected.get("frontdoor"):
        pytest.skip("no front door planned for this host")
    return expected["frontdoor"]


@pytest.fixture
def https(https_to, door):
    return https_to(door)


def test_front_door_runs_and_starts_at_boot(host, door, fix):
    unit = host.service(door["unit"])
    assert unit.is_running, f"{door['unit']} is not running; {fix} (or see: journalctl -u {door['unit']})"
    if host.file(f"/etc/systemd/system/{door['unit']}").exists:  # NixOS declares it in the module
        assert unit.is_enabled, f"{door['unit']} is not enabled at boot; {fix}"


def test_front_door_answers_with_its_current_configuration(https, door, fix):
    status, headers, err = https("/health")
    # 503: the front door answers but no vLLM replica does (start's checks report that one)
    assert status in (200, 503), f"https /health answered {status or err.strip()}; {fix}"
    assert headers.get("x-frontdoor-generation") == door["generation"], \
        f"the front door answers with another configuration ({headers.get('x-frontdoor-generation')}): " \
        f"it was not reloaded; {fix}"


def test_only_the_allowlist_goes_through_and_a_key_is_asked(https, fix):
    closed = ("/invocations", "/metrics", "/tokenize", "/scale_elastic_ep")
    models, *others = https.statuses([("/v1/models", "GET")] + [(path, "POST") for path in closed])
    assert models == 401, f"/v1/models answers without a key ({models or 'no answer'}); {fix}"
    for path, status in zip(closed, others):
        assert status == 404, f"{path} is reachable through the front door ({status or 'no answer'}); {fix}"


def test_the_front_doors_secrets_are_0600_and_hold_only_hashes(host, door, fix):
    for name in ("tls.pem", "keys.sha256"):
        f = host.file(f"{door['dir']}/{name}")
        assert f.exists and f.mode == 0o600 and f.user == "root", f"{f.path}: mode {oct(f.mode)}; {fix}"
    lines = [line for line in host.file(f"{door['dir']}/keys.sha256").content_string.splitlines()
             if line and not line.startswith("#")]
    assert all(len(line) == 64 and all(c in "0123456789abcdef" for c in line) for line in lines), \
        f"{door['dir']}/keys.sha256 holds something other than sha256 hashes; {fix}"
