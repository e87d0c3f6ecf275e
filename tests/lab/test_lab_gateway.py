"""The fleet's gateway on the lab (gateway01, on both networks): one address for every
host, keys checked there too, and a host going down (its vLLM stopped, then
another's link cut) costs no failed non-streaming request."""
import csv
import io
import json
import threading
import time

import pytest

from lab import config, sh
from tests import reliability
from tests.lab.conftest import deploy_json, front_door, invoke, ssh

GATEWAY = config.host("gateway01")
CHAT = {"model": "diffusiongemma", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


@pytest.fixture(scope="module")
def deployed(lab):
    proc, _ = deploy_json("--hosts", "spark01,rtx01,h100-01,hgx01,gateway01")
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def api_key():
    return config.API_KEY_FILE.read_text().strip()


def through_gateway(path, key=None, body=None, timeout=90):
    return front_door("gateway01", path, key, body, timeout=timeout, address=GATEWAY.address)


def states() -> dict:
    out = ssh("gateway01", "curl -sS --max-time 3 'http://127.0.0.1:8405/stats;csv'", check=False).stdout
    rows = csv.DictReader(io.StringIO(out.lstrip("# ")))
    # the DiffusionGemma pool: every serving host of the lab is in it
    return {r["svname"]: r["status"] for r in rows if r["pxname"] == "pool_diffusiongemma"
            and r["svname"] not in ("FRONTEND", "BACKEND")}


def wait_state(server, want, limit=60) -> float:
    started = time.monotonic()
    while time.monotonic() - started < limit:
        if states().get(server, "").split(" ")[0] == want:
            return time.monotonic() - started
        time.sleep(0.2)
    raise AssertionError(f"{server} not {want} in the gateway after {limit} s: {states()}")


def test_one_address_for_the_fleet_with_the_same_keys(deployed):
    assert through_gateway("/health")[0] == 200
    assert through_gateway("/v1/models")[0] == 401
    status, body, _ = through_gateway("/v1/models", api_key())
    assert status == 200 and json.loads(body)["data"][0]["id"] == "diffusiongemma"
    assert through_gateway("/invocations", api_key(), body=CHAT)[0] == 404
    seen = set()
    for _ in range(12):  # it balances: the requests reach more than one host
        status, body, _ = through_gateway("/v1/chat/completions", api_key(), CHAT)
        assert status == 200, body[:300]
    for host in ("spark01", "rtx01", "h100-01"):
        served = ssh(host, "curl -s http://127.0.0.1:8100/metrics | sed -n 's/^vllm:request_success_total{.*} //p'")
        if served.stdout.strip() not in ("", "0"):
            seen.add(host)
    assert len(seen) >= 2, seen
    assert set(states()) == {"spark01", "rtx01", "h100-01", "hgx01"}
    doc = json.loads(invoke("endpoints", "--json", "-", check=True).stdout)
    assert doc["gateway"] == f"https://{config.GATEWAY_ADDRESS}:8000/v1"  # the gateways' shared address


def test_a_host_going_down_costs_no_failed_request(deployed):
    """4 clients throughout: rtx01's vLLM stopped and started again, then spark01's link cut
    for 8 s and restored, then 3 s more: every request answered 200. (Each wait is what the
    gateway needs to see a change, plus a few requests' worth: the suite's time is CI's.)"""
    key, stop, outcomes, lock = api_key(), threading.Event(), [], threading.Lock()

    def client():
        while not stop.is_set():
            started = time.monotonic()
            try:
                status, body, _ = through_gateway("/v1/chat/completions", key, CHAT)
                result = status if status == 200 else f"{status} {body[:120]!r}"
            except OSError as exc:
                result = f"{type(exc).__name__}: {exc}"
            with lock:
                outcomes.append((started, time.monotonic() - started, result))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(4)]
    begun = time.monotonic()
    for t in threads:
        t.start()
    figures = {}
    try:
        time.sleep(3)
        ssh("rtx01", "systemctl stop podman-vllm-diffusiongemma.service")
        figures["vllm_stopped_down_s"] = wait_state("rtx01", "DOWN")
        time.sleep(5)
        ssh("rtx01", "systemctl start podman-vllm-diffusiongemma.service")
        figures["vllm_started_up_s"] = wait_state("rtx01", "UP", 120)  # after the stand-in's cold start
        time.sleep(3)
        spark = config.host("spark01")
        sh.run("ip", "link", "set", spark.veth, "down")
        try:
            figures["link_cut_down_s"] = wait_state("spark01", "DOWN")
            time.sleep(8)
        finally:
            sh.run("ip", "link", "set", spark.veth, "up")
        figures["link_back_up_s"] = wait_state("spark01", "UP", 120)
        time.sleep(3)  # the requests its return sends to spark01 again
    finally:
        stop.set()
        for t in threads:
            t.join(120)
        ssh("rtx01", "systemctl start podman-vllm-diffusiongemma.service", check=False)
    failed = [o for o in outcomes if o[2] != 200]
    slowest = max(o[1] for o in outcomes)
    assert len(outcomes) > 100 and not failed, (len(outcomes), failed[:10])
    # a dead host leaves the pool within the failover bound, live requests in flight to it or not
    # (live_answers.lua keeps a server only while its host takes the checks' connections)
    assert figures["vllm_stopped_down_s"] < 5 and figures["link_cut_down_s"] < 5, figures
    saw = (f"{len(outcomes)} requests in {time.monotonic() - begun:.0f} s from 4 clients, 0 failed (slowest "
           f"{slowest:.1f} s). vLLM stopped: DOWN in {figures['vllm_stopped_down_s']:.1f} s, UP "
           f"{figures['vllm_started_up_s']:.1f} s after systemctl start (a {config.COLD_START_S:g} s cold start); link cut: DOWN in "
           f"{figures['link_cut_down_s']:.1f} s, UP {figures['link_back_up_s']:.1f} s after the link came back")
    print(saw)
    reliability.record("gateway-vllm-stopped", "fault", "a serving host's vLLM stops behind the gateway",
                       "systemctl stop on rtx01 while 4 clients send chat completions through gateway01",
                       figures["vllm_stopped_down_s"], saw, "rtx01 DOWN in the gateway until its vLLM answered",
                       True, failed_requests=0, requests=len(outcomes))
    reliability.record("gateway-link-cut", "fault", "a serving host's link is cut behind the gateway",
                       "spark01's veth down for 8 s while 4 clients send chat completions through gateway01",
                       figures["link_cut_down_s"], saw, "spark01 DOWN, then UP once its link came back",
                       True, failed_requests=0, requests=len(outcomes))


def test_a_front_door_with_a_certificate_of_its_own_is_served_and_still_reached_by_the_gateway(deployed, lab_copy,
                                                                                           tmp_path):
    import ssl
    import urllib.request

    from credentials import ca as their_ca
    # the user's own CA (made like ours, in another folder) and a certificate from it for rtx01
    issued = their_ca.host_certificate(tmp_path / "their-ca", "rtx01", ["rtx01", "10.213.0.12"], make=True)
    files = {"tls_cert_file": (issued.cert_pem, 0o644), "tls_key_file": (issued.key_pem, 0o600),
             "tls_ca_file": (their_ca.ca_pem(tmp_path / "their-ca", make=True), 0o644)}
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    lines = []
    for var, (text, mode) in files.items():
        path = tmp_path / f"{var}.pem"
        path.write_text(text)
        path.chmod(mode)
        lines.append(f"{var}: {path}\n")
    (lab_copy / "host_vars" / "rtx01.yml").write_text("".join(lines))
    try:
        proc, _ = deploy_json("--hosts", "rtx01,gateway01", inventory=lab_copy)
        assert proc.returncode == 0, proc.stdout[-3000:]
        # a client that trusts their CA alone is served by rtx01's front door
        context = ssl.create_default_context(cafile=str(tmp_path / "tls_ca_file.pem"))
        context.check_hostname = False  # the address, not the name: what matters is who signed it
        with urllib.request.urlopen("https://10.213.0.12:8000/health", timeout=10, context=context) as resp:
            assert resp.status == 200
        # the gateway trusts their CA beside the fleet's: rtx01 stays in service
        wait_state("rtx01", "UP", limit=30)
    finally:
        assert deploy_json("--hosts", "rtx01,gateway01")[0].returncode == 0  # back to the fleet CA's
    wait_state("rtx01", "UP", limit=30)
