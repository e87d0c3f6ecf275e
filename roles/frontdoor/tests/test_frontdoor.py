"""The front door as deployed: running, the fleet CA's certificate for this host's
name, its current configuration answering, only the allowlist through, a key asked."""
import shlex

import pytest


@pytest.fixture
def door(expected):
    if not expected.get("frontdoor"):
        pytest.skip("no front door planned for this host")
    return expected["frontdoor"]


@pytest.fixture
def https(host, name, door):
    """curl on the host to its own front door, checking the certificate against the fleet
    CA under the host's inventory name: ``https(path, method)`` is (status, headers, stderr);
    ``https.statuses([(path, method), ...])`` asks them all in one curl (one program start:
    on a host under emulation each start costs ~0.4 s), a status each (0: no answer)."""
    port = door["port"]
    options = (f"--max-time 10 --cacert {shlex.quote(door['dir'] + '/ca.crt')} "
               f"--resolve {shlex.quote(f'{name}:{port}:' + door['connect'])}")

    def url(path):
        return shlex.quote(f"https://{name}:{port}{path}")

    def call(path, method="GET"):
        out = host.run(f"curl -sS -o /dev/null -D - {options} -X {method} {url(path)}")
        lines = out.stdout.replace("\r", "").splitlines()
        status = int(lines[0].split()[1]) if lines and lines[0].startswith("HTTP/") else 0
        headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:]) if v}
        return status, headers, out.stderr

    def statuses(probes):
        # each transfer its own options (--next), its status on a line of its own
        transfers = " --next ".join(f"-s -o /dev/null -w '%{{http_code}}\\n' {options} -X {method} {url(path)}"
                                    for path, method in probes)
        codes = host.run(f"curl {transfers}").stdout.split()
        return [int(c) for c in codes] + [0] * (len(probes) - len(codes))

    call.statuses = statuses
    return call


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
