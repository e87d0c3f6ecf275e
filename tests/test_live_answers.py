"""The gateway's guard of its health checks (serving/haproxy/files/live_answers.lua) in HAProxy 3.0
itself: a server whose checks time out while it answers live requests stays in its pool; the same
server with no live request to answer is taken out by its checks, as before; a server that refuses
its checks is taken out whatever it answered before. The server here answers /health never (its
checks time out, as they do behind a busy gateway's traffic) and every other request at once, or
after the seconds its path names (/slow/3)."""
from __future__ import annotations

import http.server
import re
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request

import pytest

from serving.haproxy.instance import LIVE_ANSWERS, LIVE_ANSWERS_BUSY_IDLE_PCT, live_answers
from tests.haproxy_program import haproxy
from tests.test_gateway_limits import _free_port


class Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


class Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def do_GET(self):
        if self.path == "/health":
            time.sleep(5)  # past the check's timeout: the check times out
            return
        if self.path.startswith("/slow/"):  # a request that takes this many seconds (a burst's first answers)
            time.sleep(float(self.path.rsplit("/", 1)[1]))
        body = b"ok"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _state(admin: str) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(admin)
        s.sendall(b"show stat\n")
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    lines = out.decode().splitlines()
    head = lines[0].lstrip("# ").split(",")
    row = next(dict(zip(head, line.split(","))) for line in lines[1:] if line.startswith("pool_x,one,"))
    return row["status"]


@pytest.fixture
def gateway(tmp_path, request):
    """A gateway in front of the server; it counts itself busy always (idle under 101%: the rules'
    tests), or as deploy renders it (``busy_idle_pct`` marked: an idle gateway here)."""
    marker = request.node.get_closest_marker("busy_idle_pct")
    busy = marker.args[0] if marker else 101
    backend = Server(("127.0.0.1", 0), Handler)
    threading.Thread(target=backend.serve_forever, daemon=True).start()
    port, admin = _free_port(), str(tmp_path / "admin.sock")
    (tmp_path / LIVE_ANSWERS).write_text(live_answers())
    # the gateway's check settings (roles/gateway BACKEND, gateway.cfg.j2): every second, 500 ms after
    # a failure, out after two
    (tmp_path / "haproxy.cfg").write_text(f"""global
    stats socket {admin} mode 600 level admin
    lua-load {tmp_path / LIVE_ANSWERS} {busy}
    log stdout format raw local0
defaults
    mode http
    log global
    timeout connect 1s
    timeout check 1s
    timeout client 10s
    timeout server 10s
frontend api
    bind 127.0.0.1:{port}
    default_backend pool_x
backend pool_x
    option httpchk GET /health
    default-server check inter 1s fastinter 500ms downinter 1s fall 2 rise 2
    server one 127.0.0.1:{backend.server_address[1]}
""")
    log = open(tmp_path / "haproxy.log", "w")
    proc = subprocess.Popen([haproxy(), "-db", "-f", str(tmp_path / "haproxy.cfg")], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2).read()
                break
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        yield port, admin, backend, tmp_path / "haproxy.log"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
        backend.shutdown()


def test_a_server_answering_live_requests_stays_in_while_its_checks_time_out(gateway):
    port, admin, _, log = gateway
    seen, failed = set(), []
    until = time.monotonic() + 6  # four checks' timeouts and more: two take it out without the guard
    while time.monotonic() < until:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
        except urllib.error.HTTPError as exc:
            failed.append(exc.code)
        seen.add(_state(admin).split(" ")[0])
        time.sleep(0.05)
    assert not failed and seen == {"UP"}, (failed, seen, log.read_text()[-2000:])
    assert "kept in service: its health check timed out (L7TOUT)" in log.read_text()


def test_with_no_live_request_the_checks_take_it_out_as_before(gateway):
    _, admin, _, _ = gateway
    deadline = time.monotonic() + 8
    while _state(admin) != "DOWN":
        assert time.monotonic() < deadline, _state(admin)
        time.sleep(0.2)


def test_a_server_refusing_its_checks_goes_out_whatever_it_answered(gateway):
    port, admin, backend, _ = gateway
    for _ in range(20):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
    backend.shutdown()
    backend.server_close()  # connections refused: L4CON, no timeout
    deadline = time.monotonic() + 5
    while _state(admin) != "DOWN":
        assert time.monotonic() < deadline, _state(admin)
        time.sleep(0.1)


def _get(port: int, path: str, out: list):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=60).read()
        out.append(200)
    except urllib.error.HTTPError as exc:
        out.append(exc.code)
    except OSError as exc:
        out.append(str(exc))


def test_a_burst_in_flight_keeps_it_in_before_its_first_answer(gateway):
    """Eight requests that take 4 s each: no answer comes before two checks have timed out, and the
    server holds them all the while: it stays in, and every one is answered."""
    port, admin, _, log = gateway
    out, seen = [], set()
    threads = [threading.Thread(target=_get, args=(port, "/slow/4", out)) for _ in range(8)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        seen.add(_state(admin).split(" ")[0])
        time.sleep(0.05)
    assert out == [200] * 8 and seen == {"UP"}, (out, seen, log.read_text()[-2000:])
    assert re.search(r"kept in service: its health check timed out \(L7TOUT\) while it holds \d+ live requests",
                     log.read_text())


def test_a_server_that_holds_requests_and_answers_none_goes_out_after_the_bound(gateway):
    """A front door that takes connections and answers nothing (hung): kept while it holds requests,
    at most KEEP_S, then taken out by its checks."""
    port, admin, _, _ = gateway
    keep_s = int(re.search(r"local KEEP_S = (\d+)", live_answers()).group(1))
    threads = [threading.Thread(target=_get, args=(port, "/slow/30", []), daemon=True) for _ in range(2)]
    started = time.monotonic()
    for t in threads:
        t.start()
    while _state(admin) != "DOWN":
        assert time.monotonic() - started < keep_s + 5, _state(admin)
        time.sleep(0.2)
    assert time.monotonic() - started >= keep_s


@pytest.mark.busy_idle_pct(LIVE_ANSWERS_BUSY_IDLE_PCT)
def test_a_gateway_with_time_to_spare_keeps_no_server_its_checks_time_out_on(gateway):
    """As deploy renders it, on an idle gateway: a check that timed out is the server's slowness (a
    vLLM stopping, a front door hung), not the gateway's, and the server goes out as before, live
    requests in flight or answered."""
    port, admin, _, log = gateway
    threads = [threading.Thread(target=_get, args=(port, "/slow/30", []), daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 6
    while _state(admin) != "DOWN":
        urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5).read()
        assert time.monotonic() < deadline, _state(admin)
        time.sleep(0.1)
    assert "kept in service" not in log.read_text()
