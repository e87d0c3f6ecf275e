"""What HAProxy 3.0's native counting can and cannot do, as docs/accounting.md says: the facts a
native reservation (issue 70) rests on, checked on the binary the lab's image carries, so that a
newer HAProxy that changes one fails here and the page is read again."""
import os
import socket
import subprocess
import time
import urllib.request

from tests.haproxy_program import haproxy
from tests.test_frontdoor import _free_port

CONFIG = """global
    stats socket {dir}/admin.sock mode 600 level admin
    tune.stick-counters 6
defaults
    mode http
    timeout connect 1s
    timeout client 5s
    timeout server 5s
frontend f
    bind 127.0.0.1:{port}
    http-request wait-for-body time 1s
    http-request set-var(txn.need) req.body,json_query('$.max_tokens')
    http-request track-sc{sc} str(alice) table held
    {action}
    http-request return status 200 content-type text/plain lf-string "%[sc_get_gpc(0,{sc})]"
backend held
    stick-table type string len 64 size 1k expire 10m store gpc(2)
"""


def _check(tmp_path, sc: int, action: str) -> subprocess.CompletedProcess:
    path = tmp_path / "haproxy.cfg"
    path.write_text(CONFIG.format(dir=tmp_path, port=_free_port(), sc=sc, action=action))
    return subprocess.run([haproxy(), "-c", "-f", str(path)], capture_output=True, text=True, timeout=30)


def test_sc_add_gpc_adds_an_amount_read_from_the_body_on_the_first_three_counters_alone(tmp_path):
    assert _check(tmp_path, 2, "http-request sc-add-gpc(0,2) var(txn.need)").returncode == 0
    # tune.stick-counters lets a request track more (track-sc3 is accepted, and the legacy
    # sc-inc-gpc0(3) too), but sc-add-gpc addresses sc0 to sc2 only
    assert _check(tmp_path, 3, "http-request sc-inc-gpc0(3)").returncode == 0
    refused = _check(tmp_path, 3, "http-request sc-add-gpc(0,3) var(txn.need)")
    assert refused.returncode != 0 and "The max allowed ID is 2" in refused.stdout + refused.stderr


def test_the_runtime_api_sets_a_counter_arrays_first_element_alone(tmp_path):
    port = _free_port()
    (tmp_path / "haproxy.cfg").write_text(CONFIG.format(dir=tmp_path, port=port, sc=0,
                                                        action="http-request sc-add-gpc(0,0) var(txn.need)"))
    proc = subprocess.Popen([haproxy(), "-db", "-f", str(tmp_path / "haproxy.cfg")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def api(command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(tmp_path / "admin.sock"))
            s.sendall(command.encode() + b"\n")
            return s.makefile().read()
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(tmp_path / "admin.sock"):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        for _ in range(100):
            try:
                with urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/",
                                                                   data=b'{"max_tokens": "120"}'), timeout=5) as r:
                    assert r.read() == b"120"  # json_query read a string holding a number as the number
                break
            except OSError:
                time.sleep(0.05)
        assert "Unknown data type" in api("set table held key alice data.gpc(1) 9")
        api("set table held key alice data.gpc 7")
        assert "gpc0=7 gpc1=0" in api("show table held")
    finally:
        proc.terminate()
        proc.wait(10)
