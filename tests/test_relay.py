"""The run's artifact relay (relay/server.py) against a local upstream: one fetch
upstream however many hosts ask at once, bytes served while they arrive, ranges,
nothing but the run's own URLs, nothing left behind."""
import base64
import http.client
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

import pytest

from relay.server import Relay

DATA = bytes(range(256)) * 8192  # 2 MiB


@pytest.fixture
def upstream():
    gets = []

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            gets.append((self.path, self.headers.get("Authorization")))
            if self.path != "/blob":
                self.send_response(404)
                self.send_header("Content-Length", "9")
                self.end_headers()
                self.wfile.write(b"not here\n")
                return
            self.send_response(200)
            self.send_header("Content-Length", str(len(DATA)))
            self.end_headers()
            for i in range(0, len(DATA), 256 * 1024):  # slowly: the hosts ask while it arrives
                self.wfile.write(DATA[i:i + 256 * 1024])
                self.wfile.flush()
                time.sleep(0.02)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", gets
    server.shutdown()
    server.server_close()


def get(url, headers=None):
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.netloc, timeout=30)
    conn.request("GET", parts.path, headers=headers or {})
    response = conn.getresponse()
    return response.status, response.read(), dict(response.getheaders())


def test_hosts_asking_at_once_make_one_upstream_fetch_and_all_get_every_byte(upstream):
    base, gets = upstream
    relay = Relay()
    try:
        url = relay.url("127.0.0.1", f"{base}/blob")
        results = [None] * 4

        def fetch(i):
            results[i] = get(url, {"Authorization": "Bearer hf_x"})

        threads = [threading.Thread(target=fetch, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert [r[0] for r in results] == [200] * 4 and all(r[1] == DATA for r in results)
        assert gets == [("/blob", "Bearer hf_x")]  # once, with the host's own header
        # a serving thread counts what it sent once sendfile returns, which can be after its client has
        # read the last byte: the count is waited for, not read at once
        deadline = time.monotonic() + 5
        while relay.stats["served_bytes"] < 4 * len(DATA) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert relay.stats["upstream_fetches"] == 1 and relay.stats["served_bytes"] == 4 * len(DATA)
        status, body, headers = get(url, {"Authorization": "Bearer hf_x", "Range": "bytes=1000-"})
        assert status == 206 and body == DATA[1000:] and headers["Content-Range"] == f"bytes 1000-{len(DATA) - 1}/{len(DATA)}"
        assert len(gets) == 1
    finally:
        relay.close()


def test_another_token_is_another_fetch(upstream):
    base, gets = upstream
    relay = Relay()
    try:
        url = relay.url("127.0.0.1", f"{base}/blob")
        assert get(url, {"Authorization": "Bearer a"})[1] == DATA
        assert get(url, {"Authorization": "Bearer b"})[1] == DATA
        assert [g[1] for g in gets] == ["Bearer a", "Bearer b"]
    finally:
        relay.close()


def test_only_the_runs_own_urls_and_sane_ranges(upstream):
    base, gets = upstream
    relay = Relay()
    try:
        url = relay.url("127.0.0.1", f"{base}/blob")
        other = base64.urlsafe_b64encode(b"http://169.254.169.254/latest").decode().rstrip("=")
        assert get(url.rsplit("/", 1)[0] + "/" + other)[0] == 404  # not asked for by a role: no open proxy
        assert get(url.replace(relay.token, "0" * 16))[0] == 404
        assert get(url.rsplit("/", 1)[0] + "/%%%")[0] == 404
        assert get(url, {"Range": "bytes=x-"})[0] == 416
        assert get(url, {"Range": f"bytes={len(DATA) + 5}-"})[0] == 416
        missing = relay.url("127.0.0.1", f"{base}/missing")
        status, body, _ = get(missing)
        assert status == 404 and b"not here" in body
        assert gets and all(path in ("/blob", "/missing") for path, _ in gets)
    finally:
        relay.close()


def test_close_leaves_nothing(upstream):
    base, _ = upstream
    relay = Relay()
    url = relay.url("127.0.0.1", f"{base}/blob")
    assert get(url)[1] == DATA
    folder = relay._dir
    assert any(folder.iterdir())
    relay.close()
    assert not folder.exists()
    with pytest.raises(OSError):
        get(url)


OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def test_a_multi_arch_index_goes_through_when_the_client_sends_one_accept_header_per_type():
    # as the registry does: an OCI index is served only to a client that accepts it; podman
    # sends one Accept header per media type, the index among the later ones
    seen = []

    class Registry(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_GET(self):
            accepted = ", ".join(self.headers.get_all("Accept") or [])
            seen.append(accepted)
            ok = self.path == "/v2/library/haproxy/manifests/2.6" and OCI_INDEX in accepted
            body = b'{"manifests": []}' if ok else b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}'
            self.send_response(200 if ok else 404)
            self.send_header("Content-Type", OCI_INDEX if ok else "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    relay = Relay()
    try:
        ref = relay.registry_ref("127.0.0.1", f"127.0.0.1:{server.server_address[1]}/library/haproxy:2.6")
        netloc, path = ref.split("/", 1)
        repo, tag = path.rsplit(":", 1)
        conn = http.client.HTTPConnection(netloc, timeout=30)
        conn.putrequest("GET", f"/v2/{repo}/manifests/{tag}")
        for kind in ("application/vnd.docker.distribution.manifest.v2+json", OCI_INDEX):
            conn.putheader("Accept", kind)
        conn.endheaders()
        response = conn.getresponse()
        assert (response.status, response.read()) == (200, b'{"manifests": []}')
        assert response.getheader("Content-Type") == OCI_INDEX
        assert len(seen) == 1 and OCI_INDEX in seen[0]
    finally:
        relay.close()
        server.shutdown()
        server.server_close()


def test_a_pull_that_fell_back_from_the_relay_says_why():
    from serving.relay_probe import fallback_note
    assert fallback_note("Writing manifest\n") == ""
    note = fallback_note("Trying to pull 10.213.0.1:40000/t/r0/library/haproxy:2.6...\n"
                         "Error: reading manifest 2.6: manifest unknown\n@relay-failed\n")
    assert note == ("; the run's relay failed it (Error: reading manifest 2.6: manifest unknown): "
                    "pulled from the registry itself")
