"""The front door's pieces without a host: the fleet CA and its certificates, the
key store, and the HAProxy configuration run by a real HAProxy against a small
backend (the lab tests run it in the hosts' containers)."""
import datetime
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from cryptography import x509

from credentials import CredentialError, ca as fleet_ca
from credentials.keys import KeyStore, digest
from serving import scrape_targets
from serving.haproxy.instance import GATEWAY_SEES_FLAG_S, render_unit, run_command
from serving.haproxy.config import ALLOWED, Server, render_config, render_keys
from serving.haproxy.stats import stats_rows
from serving.replicas import Served, replica
from tests.haproxy_program import haproxy


def test_the_ca_is_made_once_and_its_key_stays_0600(tmp_path):
    cert, _ = fleet_ca.ensure_ca(tmp_path, make=True)
    again, _ = fleet_ca.ensure_ca(tmp_path, make=True)
    assert cert == again
    assert oct((tmp_path / "ca" / "ca.key").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "ca" / "ca.key").chmod(0o644)
    with pytest.raises(CredentialError, match="chmod 600"):
        fleet_ca.ensure_ca(tmp_path, make=True)


def test_a_host_certificate_names_the_host_and_its_address_and_is_renewed(tmp_path, monkeypatch):
    issued = fleet_ca.host_certificate(tmp_path, "spark01", ["spark01", "10.213.0.11"], make=True)
    cert = x509.load_pem_x509_certificate(issued.cert_pem.encode())
    ca_cert, _ = fleet_ca.ensure_ca(tmp_path, make=True)
    cert.verify_directly_issued_by(ca_cert)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == ["spark01"]
    assert [str(a) for a in san.get_values_for_type(x509.IPAddress)] == ["10.213.0.11"]
    assert fleet_ca.host_certificate(tmp_path, "spark01", ["spark01", "10.213.0.11"], make=True) == issued  # kept
    moved = fleet_ca.host_certificate(tmp_path, "spark01", ["spark01", "10.213.0.99"], make=True)
    assert moved.cert_pem != issued.cert_pem  # a new address: a new certificate
    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=fleet_ca.CERT_DAYS - 10)
    monkeypatch.setattr(fleet_ca, "_now", lambda: later)
    assert fleet_ca.host_certificate(tmp_path, "spark01", ["spark01", "10.213.0.99"], make=True).cert_pem != moved.cert_pem


def test_keys_are_shown_once_and_kept_as_sha256(tmp_path):
    store = KeyStore(tmp_path)
    secret = store.add("alice")
    text = store.path.read_text()
    assert secret not in text and digest(secret) in text
    assert oct(store.path.stat().st_mode & 0o777) == "0o600"
    with pytest.raises(CredentialError, match="revoke it first"):
        store.add("alice")
    with pytest.raises(CredentialError, match="letters, digits"):
        store.add("bob; rm -rf /")
    store.add("bob")
    store.revoke("alice")
    assert list(store.hashes()) == ["bob"]
    with pytest.raises(CredentialError, match="no key named alice"):
        store.revoke("alice")
    # several at once: all of them, or none when one is not there
    store.add("carol")
    with pytest.raises(CredentialError, match=r"no key named alice, dave \(keys: bob, carol\) \(none revoked\)"):
        store.revoke("bob", "alice", "carol", "dave")
    assert list(store.hashes()) == ["bob", "carol"]
    with pytest.raises(CredentialError, match=r"no key named dave \(keys: bob, carol\); see"):
        store.revoke("dave", "dave")  # twice the same missing name: one missing key, nothing else kept
    store.revoke("carol", "bob", "carol")
    assert store.hashes() == {}
    store.add("bob")
    store.path.chmod(0o644)
    with pytest.raises(CredentialError, match="chmod 600"):
        store.load()


def test_the_units_hold_no_secret_and_name_vllms_key_only():
    unit = render_unit({"container_runtime": "docker"}, "/etc/dgemma/vllm-diffusiongemma.env")
    assert "EnvironmentFile=/etc/dgemma/vllm-diffusiongemma.env" in unit
    assert "-e VLLM_API_KEY " in unit and "HF_TOKEN" not in unit
    assert "ExecReload=/usr/bin/docker kill --signal USR2 dgemma-frontdoor" in unit
    run = run_command({"registry": "10.213.0.1:5000"})
    assert "10.213.0.1:5000/library/haproxy:3.0" in run and "--network=host" in run
    # each access-log line once, straight into the unit's journal (podman); docker has no such mode
    assert run[run.index("--log-driver") + 1] == "passthrough"
    assert "--log-driver" not in run_command({"container_runtime": "docker"})


class Backend(BaseHTTPRequestHandler):
    def _answer(self):
        sent = self.rfile.read(int(self.headers.get("content-length") or 0))
        # a request that asks to be held ({"hold": seconds}): one in flight, as a long generation
        time.sleep(float((json.loads(sent) if sent.startswith(b"{") else {}).get("hold", 0)))
        body = json.dumps({"path": self.path, "auth": self.headers.get("authorization")}).encode()
        self.send_response(200)
        self.send_header("x-backend-port", str(self.server.server_address[1]))
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args):
        pass


MONITORING_KEY = "dgk-monitoring-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def front_door(tmp_path):
    yield from _front_door(tmp_path, 1)


@pytest.fixture
def front_door_of_three(tmp_path):
    yield from _front_door(tmp_path, 3)


@pytest.fixture
def front_door_of_two_families(tmp_path):
    """Replicas 0 and 1 serve DiffusionGemma, replica 2 Gemma 4 (hgx01's kind of host)."""
    from serving.haproxy.pools import frontdoor_pools
    yield from _front_door(tmp_path, 3, lambda servers: frontdoor_pools(
        {"replica0": "diffusiongemma", "replica1": "diffusiongemma", "replica2": "gemma4"},
        {"diffusiongemma": "diffusiongemma", "gemma4": "gemma4"}, servers))


@pytest.fixture
def front_door_with_a_queue(tmp_path):
    """hgx01's kind of host, DiffusionGemma falling back on a queue: each of its two replicas
    takes one request at once, and a queue busy for two seconds makes its /health say full."""
    from dataclasses import replace

    from serving.haproxy.pools import frontdoor_pools

    def pools(servers):
        made = frontdoor_pools({"replica0": "diffusiongemma", "replica1": "diffusiongemma", "replica2": "gemma4"},
                               {"diffusiongemma": "diffusiongemma", "gemma4": "gemma4"}, servers)
        return [replace(made[0], queue={"limit": 1, "after_s": 2}), made[1]]
    yield from _front_door(tmp_path, 3, pools)


def _front_door(tmp_path, replicas: int, pools=None):
    """The rendered configuration in a real HAProxy (Debian's, as in the lab's image), before
    ``replicas`` backends (each says its port in ``x-backend-port``); ``pools(servers)``: the
    replicas by family (one family when None)."""
    haproxy()  # fails, saying how to get it, when it is not there
    backends = [ThreadingHTTPServer(("127.0.0.1", 0), Backend) for _ in range(replicas)]
    for backend in backends:
        threading.Thread(target=backend.serve_forever, daemon=True).start()
    issued = fleet_ca.host_certificate(tmp_path, "rtx01", ["rtx01", "127.0.0.1"], make=True)
    (tmp_path / "tls.pem").write_text(issued.cert_pem + issued.key_pem)
    (tmp_path / "keys.sha256").write_text(render_keys({"alice": digest("alice-key")}))
    (tmp_path / "monitoring.sha256").write_text(render_keys({"monitoring": digest(MONITORING_KEY)}))
    port = _free_port()
    v = {"api_host": "127.0.0.1", "api_port": port}
    servers = [Server(replica(v, i).server, f"127.0.0.1:{b.server_address[1]}", replica=i) for i, b in enumerate(backends)]
    (tmp_path / "targets.json").write_text(scrape_targets.render(scrape_targets.host_targets(
        "rtx01", v, [Served(replica(v, i, gpus=[f"GPU-{i}"]), "nvidia/x", 0.7) for i in range(replicas)])))
    def write_config(servers, generation="gen1"):
        config = render_config("rtx01", v, servers, generation, files=str(tmp_path),
                               socket=str(tmp_path / "admin.sock"), admin=str(tmp_path / "admin-http.sock"),
                               pools=pools(servers) if pools else None)
        config = config.replace("    user haproxy\n    group haproxy\n", "")  # this test may not run as root
        (tmp_path / "haproxy.cfg").write_text(config)
        return config

    write_config(servers)
    proc = subprocess.Popen([haproxy(), "-W", "-db", "-f", str(tmp_path / "haproxy.cfg")],
                            env={**os.environ, "VLLM_API_KEY": "vllm-own-key"},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    context = ssl.create_default_context(cafile=str(tmp_path / "ca" / "ca.crt"))
    base = f"https://127.0.0.1:{port}"

    def call(path, key=None, body=None, headers=None, timeout=10):
        req = urllib.request.Request(base + path, data=json.dumps(body).encode() if body is not None else None,
                                     headers={**({"Authorization": key} if key else {}), **(headers or {})})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
                return resp.status, json.loads(resp.read()), resp.headers
        except urllib.error.HTTPError as exc:
            raw = exc.read() or b"null"
            try:
                return exc.code, json.loads(raw), exc.headers
            except ValueError:  # HAProxy's own pages (503: no server) are HTML
                return exc.code, raw.decode(errors="replace"), exc.headers

    deadline = time.monotonic() + 10
    while True:
        try:
            if call("/health")[0] == 200:
                break
        except OSError:
            pass
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() else "slow"
        time.sleep(0.1)
    call.ports = [b.server_address[1] for b in backends]
    call.base, call.context = base, context
    call.proc, call.write_config = proc, write_config
    call.admin, call.runtime = str(tmp_path / "admin-http.sock"), str(tmp_path / "admin.sock")
    call.backends = backends
    yield call
    proc.terminate()
    proc.wait(10)
    for backend in backends:
        backend.shutdown()


def test_the_front_door_lets_through_only_the_allowlist_and_only_with_a_key(front_door):
    status, body, headers = front_door("/health")
    assert status == 200 and headers["X-Frontdoor-Generation"] == "gen1"
    for path in ALLOWED[1:]:
        assert front_door(path)[0] == 401, path
        assert front_door(path, "Bearer wrong")[0] == 401, path
    status, body, _ = front_door("/v1/models", "Bearer alice-key")
    # the user's key goes no further: vLLM gets its own
    assert status == 200 and body == {"path": "/v1/models", "auth": "Bearer vllm-own-key"}
    assert front_door("/v1/models", "bearer alice-key")[0] == 200  # the scheme in any case, as vLLM takes it
    for path in ("/invocations", "/scale_elastic_ep", "/tokenize", "/metrics", "/v1/models/x", "/load",
                 "/v1/../invocations", "/V1/models"):
        assert front_door(path, "Bearer alice-key", body={})[0] == 404, path


def test_the_hosts_metrics_open_to_the_monitoring_key_alone(front_door_of_three):
    """Each replica's /metrics, the HAProxy exporter and the scrape targets: for the monitoring
    key; a user's key and no key find nothing there, as on any route not allowed."""
    door = front_door_of_three
    paths = ["/metrics/sd", "/metrics/haproxy", "/metrics/node"] + [f"/metrics/replica/{i}" for i in range(3)]
    for path in paths + ["/metrics/replica/3", "/metrics/gpu", "/metrics"]:
        for key in (None, "Bearer alice-key", "Bearer wrong"):
            assert door(path, key)[0] == 404, (path, key)
    monitoring = f"Bearer {MONITORING_KEY}"
    for index, port in enumerate(door.ports):  # each replica's own /metrics, whatever the balance says
        status, body, headers = door(f"/metrics/replica/{index}", monitoring)
        assert status == 200 and body["path"] == "/metrics" and headers["x-backend-port"] == str(port)
    assert door("/metrics/replica/3", monitoring)[0] == 404  # no such replica here
    status, groups, _ = door("/metrics/sd", monitoring)
    assert status == 200 and {g["labels"]["job"] for g in groups} == {"frontdoor", "node", "vllm"}
    assert [g["labels"]["__metrics_path__"] for g in groups if g["labels"]["job"] == "vllm"] == \
        [f"/metrics/replica/{i}" for i in range(3)]
    with pytest.raises(ValueError):  # HAProxy's exporter: Prometheus text, not JSON
        door("/metrics/haproxy", monitoring)
    import urllib.request
    req = urllib.request.Request(door.base + "/metrics/haproxy", headers={"Authorization": monitoring})
    with urllib.request.urlopen(req, timeout=10, context=door.context) as resp:
        assert b"haproxy_server_status" in resp.read()
    # the node exporter is not running here: a failed scrape (503), not another route
    assert door("/metrics/node", monitoring)[0] == 503


def test_the_catalog_names_the_official_haproxy_and_the_lab_publishes_that_tag():
    from lab import config
    from serving.haproxy.instance import image_ref
    from serving.catalog import images
    official = images()["frontdoor"]
    assert image_ref({}) == f"docker.io/{official['repository']}:{official['tag']}"
    assert image_ref({"registry": "10.213.0.1:5000"}) == f"10.213.0.1:5000/{official['repository']}:{official['tag']}"
    assert image_ref({"frontdoor_image": "quay.io/me/haproxy:3.0"}) == "quay.io/me/haproxy:3.0"
    # the lab's registry stands for Docker Hub: it holds what the catalog names
    assert (config.FRONTDOOR_REPOSITORY, config.FRONTDOOR_TAG) == (official["repository"], official["tag"])


def _own(tmp_path, host="rtx01", names=("rtx01", "10.213.0.12")):
    """A certificate from a CA of the user's own (another folder's CA), as files on the control machine."""
    other = tmp_path / "their-ca"
    issued = fleet_ca.host_certificate(other, host, list(names), make=True)
    files = {}
    for name, text, mode in (("cert.pem", issued.cert_pem, 0o644), ("key.pem", issued.key_pem, 0o600),
                             ("ca.pem", fleet_ca.ca_pem(other, make=True), 0o644)):
        path = tmp_path / name
        path.write_text(text)
        path.chmod(mode)
        files[name] = str(path)
    return files, issued


def test_a_certificate_of_ones_own_is_checked_and_its_ca_trusted_beside_the_fleets(tmp_path):
    from converge.errors import StepFailed
    from serving.fleet import fleet_of
    from serving.haproxy import tls
    files, issued = _own(tmp_path)
    v = {"credentials_dir": str(tmp_path / "fleet"), "tls_cert_file": files["cert.pem"],
         "tls_key_file": files["key.pem"], "tls_ca_file": files["ca.pem"]}
    got = tls.bundle("rtx01", v, make=True)
    fleet_pem = fleet_ca.ca_pem(tmp_path / "fleet", make=True)
    assert got.cert_pem == issued.cert_pem and got.key_pem == issued.key_pem
    assert got.ca_pem.startswith(fleet_pem) and open(files["ca.pem"]).read() in got.ca_pem
    # the gateway trusts the CAs of the front doors that bring their own
    door = fleet_of({"rtx01": {**v, "ansible_host": "10.213.0.12"}}).serving[0]
    assert door.ca_file == files["ca.pem"]
    gateway = tls.bundle("gateway01", {"credentials_dir": str(tmp_path / "fleet")}, (door.ca_file,), make=True)
    assert open(files["ca.pem"]).read() in gateway.ca_pem and gateway.ca_pem.count("BEGIN CERTIFICATE") == 2
    # what would leave a front door nobody can reach is an error at deploy, naming the host and the file
    with pytest.raises(StepFailed, match="set tls_ca_file to the CA certificate that signed it"):
        tls.bundle("rtx01", {**v, "tls_ca_file": ""}, make=True)
    with pytest.raises(StepFailed, match="not rtx01: .*add DNS:rtx01"):
        tls.bundle("rtx01", {**v, **dict(zip(("tls_cert_file", "tls_key_file", "tls_ca_file"),
                                             _own(tmp_path / "b", "other01", ("other01",))[0].values()))}, make=True)
    wrong_key = _own(tmp_path / "c")[0]["key.pem"]
    with pytest.raises(StepFailed, match="is not this certificate's key"):
        tls.bundle("rtx01", {**v, "tls_key_file": wrong_key}, make=True)
    os.chmod(files["key.pem"], 0o644)
    with pytest.raises(StepFailed, match="chmod 600"):
        tls.bundle("rtx01", v, make=True)


def _roll_shell(door, index: int, command: str) -> str:
    """The rolling deploy's own shell (files/admin.sh: drain, ready, state) against this front
    door, run by dash as a host's sh runs it; ``$S`` is replica ``index``'s server."""
    from serving.haproxy.admin import ADMIN_LIBRARY, admin_parameters
    from serving.host_programs import Program
    from serving.replica_ready import PRELUDE
    params = {**admin_parameters(), "ADMIN": door.admin, "RUNTIME": door.runtime, "S": replica({}, index).server}
    script = Program((PRELUDE, ADMIN_LIBRARY)).script(params) + command + "\n"
    proc = subprocess.run(["dash", "-c", script], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout.strip()


def reload_as_the_deploy_does(proxy, config: str, state_dir, proc) -> None:
    """The deploy's reload on a test's HAProxy (files/keep_states.sh, then the signal systemctl's
    reload sends): the servers' states dumped through its runtime API into ``state_dir``, then
    SIGUSR2 to its master."""
    from serving.haproxy.instance import runtime_socket
    from serving.haproxy.steps import KEEP_STATES, kept_servers
    from serving.host_programs import Program
    script = Program((KEEP_STATES,)).script({
        "STATE_FILE": f"{state_dir}/servers.state", "KEPT_SERVERS": "\n".join(kept_servers(config)),
        "RUNTIME_SOCKET": runtime_socket(proxy).replace(proxy.socket_dir, str(state_dir))})
    subprocess.run(["dash", "-c", script + f"keep_states\nkill -USR2 {proc.pid}\n"], check=True, timeout=30)


def until_reloaded(proc, taken, said=lambda: "the reload did not take") -> None:
    """Until ``taken()``, within 10 s of the reload; signalled once more after 3 s, as the
    deploy's wait does (proxy.wait_script): HAProxy's master now and then acts on no
    SIGUSR2 on a loaded machine (seen on 2.6), and a second one takes."""
    signalled, again = time.monotonic(), True
    while not taken():
        if again and time.monotonic() > signalled + 3:
            proc.send_signal(signal.SIGUSR2)
            again = False
        assert time.monotonic() < signalled + 10, said()
        time.sleep(0.1)


def test_a_drained_replica_gets_no_new_request_but_its_gate_reaches_it(front_door_of_three):
    door = front_door_of_three
    time.sleep(2.5)  # every server's first health check has passed (inter 2s)
    assert _roll_shell(door, 1, "fd_state") == "0 UP"
    assert _roll_shell(door, 1, "admin drain && echo drained") == "drained"
    assert _roll_shell(door, 1, "fd_state") == "0 DRAIN"
    seen = {door("/v1/models", "Bearer alice-key")[2]["x-backend-port"] for _ in range(12)}
    assert seen == {str(door.ports[0]), str(door.ports[2])}
    # the gate: a keyed request that names the drained replica reaches it
    pinned = door("/v1/models", "Bearer alice-key", headers={"X-Dgemma-Replica": "1"})
    assert pinned[0] == 200 and pinned[2]["x-backend-port"] == str(door.ports[1])
    assert door("/health")[0] == 200  # the host still serves: the gateway keeps it
    for index in (0, 2):
        _roll_shell(door, index, "admin drain")
    # every replica drained but up: /health says 404 (the gateway's disable-on-404 takes the
    # host out of balancing), and a request no replica may take gets 503 (the gateway retries it)
    status, body, _ = door("/health")
    assert (status, body) == (404, {"status": "draining"})
    assert door("/v1/models", "Bearer alice-key")[0] == 503
    for index in range(3):
        assert _roll_shell(door, index, "admin ready && fd_state") == "0 UP"
    assert door("/health")[0] == 200


def test_a_roll_s_flag_keeps_health_at_404_while_its_replica_is_stopped(front_door):
    """The host's last replica drained and then stopped: with the roll's flag up the front door
    says 404 (the gateway shows the host drained) for the whole roll; lowered, 503 (down)."""
    door = front_door
    time.sleep(2.5)
    assert _roll_shell(door, 0, "flag ready && admin drain && echo out") == "out"
    assert door("/health")[:2] == (404, {"status": "draining"})
    door.backends[0].shutdown()
    door.backends[0].server_close()  # the replica stopped: its checks fail
    deadline = time.monotonic() + 15
    while _roll_shell(door, 0, "fd_state").split()[-1] != "DOWN":
        assert time.monotonic() < deadline, "the front door never saw the replica down"
        time.sleep(0.3)
    assert door("/health")[:2] == (404, {"status": "draining"})
    assert _roll_shell(door, 0, "admin ready && flag maint && echo back") == "back"
    assert door("/health")[0] == 503  # down, as the gateway should see it


def test_the_gateway_takes_a_draining_front_door_out_of_balancing():
    from serving.haproxy.instance import GATEWAY
    from roles.gateway.role import BACKEND
    config = render_config("gateway01", {}, [Server("rtx01", "10.213.0.12:8000")], "g", proxy=GATEWAY, backend=BACKEND)
    backend = config.split("backend pool_diffusiongemma", 1)[1].split("\nfrontend", 1)[0]
    assert "http-check disable-on-404" in backend
    assert "http-check send meth GET uri /health hdr X-Dgemma-Pool diffusiongemma" in backend
    assert "draining" not in config.split("backend pool_", 1)[0]  # a gateway's /health is its own servers'


def test_the_front_door_balances_its_replicas_and_a_request_may_name_one(front_door_of_three):
    door = front_door_of_three
    time.sleep(2.5)  # every server's first health check has passed (inter 2s)
    seen = {door("/v1/models", "Bearer alice-key")[2]["x-backend-port"] for _ in range(12)}
    assert seen == {str(p) for p in door.ports}
    for index, port in enumerate(door.ports):
        pinned = {door("/v1/models", "Bearer alice-key", headers={"X-Dgemma-Replica": str(index)})[2]["x-backend-port"]
                  for _ in range(4)}
        assert pinned == {str(port)}
    # the header counts only with a key
    assert door("/v1/models", headers={"X-Dgemma-Replica": "1"})[0] == 401


def test_a_request_goes_to_the_pool_of_the_model_it_names(front_door_of_two_families):
    door = front_door_of_two_families
    time.sleep(2.5)  # every server's first health check has passed (inter 2s)
    key, dg, g4 = "Bearer alice-key", {str(p) for p in door.ports[:2]}, str(door.ports[2])

    def served(body, headers=None):
        status, _, answer = door("/v1/chat/completions", key, body=body, headers=headers)
        assert status == 200, body
        return answer["x-backend-port"], answer["x-dgemma-pool"]

    assert {served({"model": "gemma4", "messages": []}) for _ in range(4)} == {(g4, "gemma4")}
    assert {served({"model": "google/gemma-4-26B-A4B-it"})[0] for _ in range(4)} == {g4}
    assert {served({"model": "diffusiongemma"})[0] for _ in range(8)} == dg
    assert {served({"messages": []})[0] for _ in range(8)} == dg  # no model: the first pool's, as vLLM's own
    # the gateway's fallback names the pool: DiffusionGemma's request to a Gemma 4 replica
    assert served({"model": "diffusiongemma"}, {"X-Dgemma-Pool": "gemma4"}) == (g4, "gemma4")
    # a model nobody serves: vLLM's 404 and error body, the name escaped as JSON
    status, body, _ = door("/v1/chat/completions", key, body={"model": 'gpt-"5"', "messages": []})
    assert status == 404 and body == {"error": {
        "message": 'The model `gpt-"5"` does not exist. Valid aliases: diffusiongemma, gemma4.',
        "type": "NotFoundError", "param": "model", "code": 404}}
    assert door("/v1/chat/completions", body={"model": "gpt-5"})[0] == 401  # the key first, as vLLM's middleware
    # one URL lists both families
    status, body, _ = door("/v1/models", key)
    assert status == 200 and [m["id"] for m in body["data"]] == ["diffusiongemma", "gemma4"]
    assert all(m["object"] == "model" and m["owned_by"] == "vllm" for m in body["data"])


def test_a_family_drained_says_so_for_its_pool_alone(front_door_of_two_families):
    door = front_door_of_two_families
    time.sleep(2.5)
    assert _roll_shell(door, 2, "admin drain && echo out") == "out"
    assert door("/health", headers={"X-Dgemma-Pool": "gemma4"})[:2] == (404, {"status": "draining"})
    assert door("/health", headers={"X-Dgemma-Pool": "diffusiongemma"})[0] == 200
    assert door("/health")[0] == 200  # the host as a whole still serves
    assert _roll_shell(door, 2, "admin ready && echo back") == "back"
    assert door("/health", headers={"X-Dgemma-Pool": "gemma4"})[0] == 200


def test_a_family_whose_replicas_are_down_is_down_for_its_pool_not_drained(front_door_of_two_families):
    """Gemma 4's replica stopped (not drained): its pool's /health says 503, so the gateway
    marks the host DOWN for it (a drained pool says 404: NOLB); DiffusionGemma's still 200."""
    door = front_door_of_two_families
    time.sleep(2.5)
    door.backends[2].shutdown()
    door.backends[2].server_close()
    deadline = time.monotonic() + 15
    while _roll_shell(door, 2, "fd_state").split()[-1] != "DOWN":
        assert time.monotonic() < deadline, "the front door never saw the replica down"
        time.sleep(0.3)
    for _ in range(3):  # the gateways' checks of the stopped pool, answered by the front door itself
        assert door("/health", headers={"X-Dgemma-Pool": "gemma4"})[0] == 503
    assert door("/health", headers={"X-Dgemma-Pool": "diffusiongemma"})[0] == 200
    # so pool_gemma4's counters hold users' requests alone (DgemmaServerErrors reads them)
    assert _pool_5xx(door, "gemma4") == 0
    assert door("/v1/chat/completions", "Bearer alice-key", {"model": "gemma4"})[0] == 503
    assert _pool_5xx(door, "gemma4") == 1


def _pool_load(door, family: str) -> tuple[dict[str, int], int]:
    """The requests each server of ``family``'s pool is answering, and how many wait (the
    pool's queue and its servers' own)."""
    rows = [r for r in stats_rows(_roll_shell(door, 0, "stats_csv")) if r["pxname"] == f"pool_{family}"]
    serving = {r["svname"]: int(r["scur"] or 0) for r in rows if r["svname"] != "BACKEND"}
    return serving, sum(int(r["qcur"] or 0) for r in rows)  # the BACKEND row's qcur: those with no server yet


def _pool_5xx(door, family: str) -> int:
    rows = stats_rows(_roll_shell(door, 0, "stats_csv"))
    return next(int(r["hrsp_5xx"] or 0) for r in rows if (r["pxname"], r["svname"]) == (f"pool_{family}", "BACKEND"))


def test_a_request_in_flight_through_its_pool_counts_for_its_replica(front_door_of_two_families):
    """A family's requests go through pool_<family>, whose servers track the replicas': the
    rolling deploy's drain waits on what the replica has in flight by either way."""
    door = front_door_of_two_families
    time.sleep(2.5)
    held = threading.Thread(target=door, args=("/v1/chat/completions", "Bearer alice-key",
                                               {"model": "gemma4", "hold": 3}))
    held.start()
    time.sleep(1)
    assert [_roll_shell(door, i, "fd_state") for i in range(3)] == ["0 UP", "0 UP", "1 UP"]
    held.join()
    assert _roll_shell(door, 2, "fd_state") == "0 UP"


def test_a_family_whose_replicas_are_all_busy_with_a_queue_past_its_time_says_full(front_door_with_a_queue):
    """Each DiffusionGemma replica at its limit (one request) and a third request queued: the
    pool's /health (what the gateways check) says 200 until the queue has been busy for two
    seconds (to within one: dates in seconds), then 404 full (the gateways fall back); the queued request waits and is answered;
    the queue empty, 200 again. Gemma 4's pool, and the host, say 200 throughout."""
    door = front_door_with_a_queue
    time.sleep(2.5)
    dg = {"X-Dgemma-Pool": "diffusiongemma"}
    assert door("/health", headers=dg)[:2] == (200, {"status": "ok"})
    answers = []

    def held():
        # the queued one waits 5 s for a replica, then is held 5 s: more than the usual 10 s
        answers.append(door("/v1/chat/completions", "Bearer alice-key", {"model": "diffusiongemma", "hold": 5},
                            timeout=30)[0])

    clients = [threading.Thread(target=held) for _ in range(3)]
    for client in clients:
        client.start()
    # each replica at its limit and the third request waiting: in the pool's queue, or in one
    # server's own (two requests that arrive together may both pick the same least-loaded replica)
    deadline = time.monotonic() + 3
    while (load := _pool_load(door, "diffusiongemma")) != ({"replica0": 1, "replica1": 1}, 1):
        assert time.monotonic() < deadline, load
        time.sleep(0.1)
    started, seen = time.monotonic(), []
    while (got := door("/health", headers=dg))[0] == 200:
        seen.append(time.monotonic() - started)
        assert time.monotonic() - started < 3.5, "the pool never said full"
        time.sleep(0.2)
    assert got[:2] == (404, {"status": "full"}) and seen  # it said 200 first, as the queue began
    assert door("/health", headers={"X-Dgemma-Pool": "gemma4"})[0] == 200 and door("/health")[0] == 200
    for client in clients:
        client.join()
    assert answers == [200, 200, 200]  # the queued one too (it waited about 5 s)
    assert door("/health", headers=dg)[0] == 200


def test_a_reload_keeps_a_down_servers_state_and_takes_a_moved_servers_new_port(front_door_of_three, tmp_path):
    """What deploy's reload does (proxy.reload_action): the servers' states dumped through the
    runtime API, then SIGUSR2. A replica found down stays down in the new instance (not called
    up until its checks, which would send it requests); a replica whose port moved in the new
    configuration is reached at the new port (HAProxy would restore the old one from the file)."""
    from serving.haproxy.instance import FRONTDOOR
    door = front_door_of_three
    time.sleep(2.5)
    door.backends[2].shutdown()
    door.backends[2].server_close()
    deadline = time.monotonic() + 15
    while _roll_shell(door, 2, "fd_state").split()[-1] != "DOWN":
        assert time.monotonic() < deadline, "the front door never saw replica 2 down"
        time.sleep(0.3)
    moved = ThreadingHTTPServer(("127.0.0.1", 0), Backend)
    threading.Thread(target=moved.serve_forever, daemon=True).start()
    servers = [Server("replica0", f"127.0.0.1:{door.ports[0]}", replica=0),
               Server("replica1", f"127.0.0.1:{moved.server_address[1]}", replica=1),
               Server("replica2", f"127.0.0.1:{door.ports[2]}", replica=2)]
    config = door.write_config(servers, "gen2")
    reload_as_the_deploy_does(FRONTDOOR, config, tmp_path, door.proc)
    state = [line.split() for line in (tmp_path / "servers.state").read_text().splitlines()[2:] if line]
    carried = {(f[1], f[3]): f[5] for f in state}  # (backend, server): srv_op_state (0: down, 2: up)
    assert carried[("servers", "replica2")] == "0" and carried[("servers", "replica0")] == "2"
    assert ("servers", "replica1") not in carried  # moved: not carried over
    until_reloaded(door.proc, lambda: door("/health")[2].get("x-frontdoor-generation") == "gen2")
    # from the new instance's first moment: replica 2 down, replica 1 at its new port
    assert _roll_shell(door, 2, "fd_state").split()[-1] == "DOWN"
    ports = {door("/v1/chat/completions", "Bearer alice-key", {"messages": []})[2]["x-backend-port"]
             for _ in range(8)}
    assert ports == {str(door.ports[0]), str(moved.server_address[1])}
    moved.shutdown()
    moved.server_close()


def test_a_roll_taking_a_pools_last_replicas_raises_its_flag_first(front_door_of_two_families):
    """The rolling deploy's shell: which pools a roll of some replicas leaves with none in service,
    and each pool's flag, which makes /health 404 for that pool alone (the gateway stops sending
    its family here before the replicas are drained)."""
    door = front_door_of_two_families
    time.sleep(2.5)
    assert _roll_shell(door, 0, 'leaving_pools " replica2 "') == "gemma4"
    assert _roll_shell(door, 0, 'leaving_pools " replica0 "') == ""  # replica 1 still serves DiffusionGemma
    assert _roll_shell(door, 0, 'leaving_pools " replica0 replica1 "') == "diffusiongemma"
    assert _roll_shell(door, 0, "pool_flag gemma4 ready && raised_pool_flags") == "gemma4"
    assert door("/health", headers={"X-Dgemma-Pool": "gemma4"})[:2] == (404, {"status": "draining"})
    assert door("/health", headers={"X-Dgemma-Pool": "diffusiongemma"})[0] == 200
    # its replica still answers what reaches it (requests in flight, or sent before the gateway's check)
    assert door("/v1/chat/completions", "Bearer alice-key", body={"model": "gemma4"})[0] == 200
    assert _roll_shell(door, 0, "pool_flag gemma4 maint && raised_pool_flags") == ""
    assert door("/health", headers={"X-Dgemma-Pool": "gemma4"})[0] == 200


def test_a_roll_waits_for_every_gateway_to_check_the_pool_again_not_a_fixed_time(front_door_of_two_families):
    """The gateways' checks (a pool's /health, no key) are counted by where they come from; what a
    gateway passes on carries its key and is no check. Once a pool's flag is up, the roll waits
    until each one checking has asked again (its answer was 404), or the most a check takes when
    one stops asking or none is seen."""
    door = front_door_of_two_families
    for _ in range(3):
        door("/health", headers={"X-Dgemma-Pool": "gemma4"})
    door("/health", "Bearer alice-key", headers={"X-Dgemma-Pool": "gemma4"})  # passed on by a gateway
    assert _roll_shell(door, 0, "checks_seen ' gemma4'") == "127.0.0.1@gemma4 3"
    assert _roll_shell(door, 0, "checks_seen diffusiongemma") == ""
    assert _roll_shell(door, 0, "pool_flag gemma4 ready && raised_pool_flags") == "gemma4"
    stop, answers = threading.Event(), []

    def gateway():  # checks gemma4 every 0.3 s, as the gateway's http-check does
        while not stop.wait(0.3):
            answers.append(door("/health", headers={"X-Dgemma-Pool": "gemma4"})[0])
    checking = threading.Thread(target=gateway)
    checking.start()
    try:
        said = _roll_shell(door, 0, "gateways_see ' gemma4'")
    finally:
        stop.set()
        checking.join()
    assert said.split()[0] == "seen" and answers and set(answers) == {404}, (said, answers)
    # the checker stopped asking (its entry is still there): the most a check takes
    how, took = _roll_shell(door, 0, "gateways_see gemma4").split()
    assert how == "waited" and int(took) >= GATEWAY_SEES_FLAG_S * 1000, (how, took)
    # nobody checks that pool here at all: the same
    how, took = _roll_shell(door, 0, "gateways_see diffusiongemma").split()
    assert how == "waited" and int(took) >= GATEWAY_SEES_FLAG_S * 1000, (how, took)


@pytest.fixture(params=[False, True], ids=["header", "refuse"])
def front_door_naming_ignored(tmp_path, request):
    """hgx01's kind of host, with the catalog's ignored_parameters on each family's pool, as the
    front door role sets them (ignored_parameters: header, or refuse)."""
    from dataclasses import replace

    from serving import catalog
    from serving.haproxy.pools import frontdoor_pools

    def pools(servers):
        made = frontdoor_pools({"replica0": "diffusiongemma", "replica1": "gemma4"},
                               {"diffusiongemma": "diffusiongemma", "gemma4": "gemma4"}, servers)
        families = catalog.models()["families"]
        return [replace(p, ignored=tuple(families[p.name].get("ignored_parameters") or ()),
                        refuse_ignored=request.param) for p in made]
    door = _front_door(tmp_path, 2, pools)
    call = next(door)
    call.refuse = request.param
    yield call
    next(door, None)


def test_a_parameter_the_model_ignores_is_named_on_the_answer_or_refused(front_door_naming_ignored):
    """DiffusionGemma's penalties (seed 000: "penalty-family parameters are ignored"): the
    answer says so, or the request is refused naming the parameter; Gemma 4 applies them."""
    door, key = front_door_naming_ignored, "Bearer alice-key"
    time.sleep(2.5)
    body = {"model": "diffusiongemma", "messages": [], "presence_penalty": 0.5, "frequency_penalty": 0.2}
    status, answer, headers = door("/v1/chat/completions", key, body=body)
    if door.refuse:
        assert status == 400 and answer["error"]["type"] == "BadRequestError", answer
        assert answer["error"]["param"] in ("frequency_penalty", "presence_penalty")
        assert "diffusiongemma ignores it" in answer["error"]["message"]
    else:
        assert status == 200 and sorted(headers.get_all("x-dgemma-ignored-parameters")) == \
            ["frequency_penalty", "presence_penalty"]
    # no model named: the first pool's (DiffusionGemma's) too
    status, _, headers = door("/v1/chat/completions", key, body={"messages": [], "repetition_penalty": 1.1})
    assert (status, headers.get("x-dgemma-ignored-parameters")) == ((400, None) if door.refuse else (200, "repetition_penalty"))
    # what it applies is not named; Gemma 4 applies the penalties
    for body in ({"model": "diffusiongemma", "messages": [], "temperature": 0.3},
                 {"model": "gemma4", "messages": [], "presence_penalty": 0.5}):
        status, _, headers = door("/v1/chat/completions", key, body=body)
        assert status == 200 and headers.get("x-dgemma-ignored-parameters") is None, body


def test_deploy_puts_back_what_a_cut_roll_left_out_and_its_result_names_what_it_could_not(front_door_of_three):
    """files/back.sh against a real front door: two replicas drained and the roll's flag up (a roll
    killed mid-way) are put back and the flag lowered; a server the front door does not have is
    refused, named in the result, and the others are still put back."""
    from roles.frontdoor.back import BACK, BACK_PROGRAM
    from serving.haproxy.admin import admin_parameters
    door = front_door_of_three
    time.sleep(2.5)
    _roll_shell(door, 0, "flag ready && admin drain")
    _roll_shell(door, 2, "admin drain")
    assert [_roll_shell(door, i, "fd_state") for i in range(3)] == ["0 DRAIN", "0 UP", "0 DRAIN"]
    flag_state = "stats_csv | awk -F, -v b=\"$ROLLING_BACKEND\" -v f=\"$ROLLING_SERVER\" '$1 == b && $2 == f {print $18}'"
    assert _roll_shell(door, 0, flag_state) == "no check"  # the roll's flag is up (in service, unchecked)

    def back(servers: str):
        script = BACK_PROGRAM.script({**admin_parameters(), "ADMIN": door.admin, "SERVERS": servers})
        proc = subprocess.run(["dash", "-c", script], capture_output=True, text=True, timeout=30)
        assert proc.stdout.splitlines()[-1].startswith("@result "), proc.stdout + proc.stderr
        return proc.returncode, BACK.result_of(proc.stdout)
    rc, said = back(f"{replica({}, 0).server} replica9 {replica({}, 2).server}")
    assert rc == BACK.exit("refused") and said == {"in_service": "replica0 replica2", "refused": "replica9",
                                                    "flags_refused": ""}
    assert [_roll_shell(door, i, "fd_state") for i in range(3)] == ["0 UP"] * 3
    assert _roll_shell(door, 0, flag_state) == "MAINT"  # and lowered
    assert back("") == (0, {"in_service": "", "refused": "", "flags_refused": ""})
