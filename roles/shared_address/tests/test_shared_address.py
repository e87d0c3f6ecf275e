"""The gateways' shared address as deployed: keepalived running with the configuration
deploy wrote, the address answering https, and held by exactly one gateway."""
import shlex

import pytest
import testinfra

from converge.verify import TRANSPORTS
from roles.shared_address.keepalived import holds, parse_addresses


@pytest.fixture
def shared(expected):
    if not expected.get("shared_address"):
        pytest.skip("n/a: no gateway_address in the inventory")
    return expected["shared_address"]


def test_keepalived_runs_and_starts_at_boot(host, shared, fix):
    unit = host.service(shared["unit"])
    assert unit.is_running, f"{shared['unit']} is not running; {fix} (or see: journalctl -u {shared['unit']})"
    assert unit.is_enabled, f"{shared['unit']} is not enabled at boot; {fix}"


def test_keepalived_has_the_configuration_deploy_wrote(host, shared, fix):
    conf = host.file(shared["config"])
    assert conf.exists, f"{shared['config']} is missing; {fix}"
    assert conf.sha256sum == shared["config_sha256"], f"{shared['config']} was changed on the host; {fix}"


def test_the_shared_address_answers_https(host, shared):
    port, address = shared["port"], shared["address"]
    # by the address, which every gateway's certificate names: the holder may be another gateway
    out = host.run(f"curl -sS -o /dev/null -D - --max-time 5 --cacert {shlex.quote(shared['ca'])} "
                   f"{shlex.quote(f'https://{address}:{port}/health')}")
    lines = out.stdout.replace("\r", "").splitlines()
    assert lines and lines[0].startswith("HTTP/"), \
        f"https://{address}:{port} does not answer ({out.stderr.strip()[-200:]}): no gateway holds it, or the " \
        f"one that does has no HAProxy; see: invoke status"
    answered = next((line.split(":", 1)[1].strip() for line in lines if line.lower().startswith("x-dgemma-gateway:")),
                    None)
    assert answered in shared["gateways"], f"{address} is answered by {answered or 'something that is no gateway'}"


def test_one_gateway_holds_the_shared_address(shared):
    """Across the gateways of this run: two holders is a split (they do not hear each
    other), none is an outage."""
    holders, reached = [], []
    for gateway in shared["gateways"]:
        if gateway not in TRANSPORTS:
            continue
        reached.append(gateway)
        out = testinfra.get_host(f"converge://{gateway}").run("ip -o -4 addr show")
        if holds(shared["address"], parse_addresses(out.stdout)):
            holders.append(gateway)
    assert len(holders) <= 1, \
        f"split: {' and '.join(holders)} each hold {shared['address']}: they do not hear each other's VRRP (check " \
        f"the link between them and IP protocol 112 through their firewalls; journalctl -u keepalived on each)"
    assert holders or len(reached) < len(shared["gateways"]), \
        f"no gateway holds {shared['address']}: see invoke status and journalctl -u keepalived on {', '.join(reached)}"
