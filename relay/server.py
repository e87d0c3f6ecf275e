"""The artifact relay of a run: each artifact crosses the uplink once.

When several hosts of one run need the same artifact (a model's blobs, an
image's layers), they fetch it through this relay, an HTTP server of the
control process that lives as long as the run. The first request for an
artifact starts one fetch from upstream, written to a file of the run's own
directory as it comes; every request for it (the first included, and any
range, while it is still arriving) is served from that file as soon as the
bytes are there. So all hosts download at once, at the uplink's speed, and the
uplink carries each byte once.

Why the control machine, not a host: it needs nothing installed or opened on
any host (hosts fetch with the curl and container runtime they already use),
leaves no credential anywhere (a host's Authorization header is passed
upstream as it came, and the cache is keyed by it, so no host gets what its
own token could not read), and is gone, files and all, when the run ends. A
host that cannot reach it (behind a bastion, say) is told and fetches from
upstream itself. The price: the control machine holds each artifact on its
disk for the run, and relays it over its own link.

Upstream registries are spoken to as Distribution's API: a host pulls
``ADDR:PORT/<token>/r<N>/<repo>:<tag>`` with TLS verification off (the relay is
plain HTTP on the lab network); blobs are cached by digest.
"""
from __future__ import annotations

import base64
import hashlib
import os
import re
import secrets
import shutil
import tempfile
import threading
from pathlib import Path
from urllib.parse import urlsplit

CHUNK = 1024 * 1024
PASSED_UP = ("Authorization", "Accept", "User-Agent")
PASSED_DOWN = ("Content-Type", "ETag", "X-Repo-Commit", "X-Linked-Etag", "X-Linked-Size", "Docker-Content-Digest",
               "Docker-Distribution-Api-Version", "WWW-Authenticate", "Accept-Ranges")
ROOM_MARGIN = 1024 ** 3  # the relay keeps this much free on the control machine's disk


class _Artifact:
    """One upstream resource, arriving into a file; readers wait on ``cond``."""

    def __init__(self, path: Path):
        self.path = path
        self.cond = threading.Condition()
        self.status: int | None = None
        self.headers: dict = {}
        self.size: int | None = None
        self.have = 0
        self.done = False
        self.failed: str | None = None
        self.body = b""  # an error's body, passed on as it came


def _fetch(artifact: _Artifact, url: str, headers: dict, stats: dict, lock: threading.Lock):
    """GET ``url`` (following redirects, dropping credentials across hosts) into the artifact."""
    import http.client  # here, not at the top: most runs never fetch (a no-op starts faster)
    try:
        for _ in range(6):
            parts = urlsplit(url)
            conn_class = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
            conn = conn_class(parts.netloc, timeout=60)
            conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers)
            response = conn.getresponse()
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                location = response.getheader("Location")
                target = location if "://" in location else f"{parts.scheme}://{parts.netloc}{location}"
                if urlsplit(target).netloc != parts.netloc:
                    headers = {k: v for k, v in headers.items() if k != "Authorization"}
                url = target
                response.read()
                conn.close()
                continue
            break
        else:
            raise OSError("too many redirects")
        length = response.getheader("Content-Length")
        if response.status == 200 and length is not None:
            free = shutil.disk_usage(artifact.path.parent).free
            if int(length) + ROOM_MARGIN > free:
                raise OSError(f"no room on the control machine for {int(length)} bytes ({free} free)")
        # the file exists before anyone hears of the response: readers open it right away
        out = open(artifact.path, "wb")
        with artifact.cond:
            artifact.status = response.status
            artifact.headers = {k: response.getheader(k) for k in PASSED_DOWN if response.getheader(k)}
            artifact.size = int(length) if length is not None else None
            artifact.cond.notify_all()
        if response.status != 200:
            out.close()
            artifact.body = response.read(64 * 1024)
            with artifact.cond:
                artifact.done = True
                artifact.cond.notify_all()
            return
        with lock:
            stats["upstream_fetches"] += 1
        with out:
            while True:
                piece = response.read(CHUNK)
                if not piece:
                    break
                out.write(piece)
                out.flush()
                with lock:
                    stats["upstream_bytes"] += len(piece)
                with artifact.cond:
                    artifact.have += len(piece)
                    artifact.cond.notify_all()
        with artifact.cond:
            if artifact.size is not None and artifact.have != artifact.size:
                raise OSError(f"upstream ended at {artifact.have} of {artifact.size} bytes")
            artifact.size = artifact.have
            artifact.done = True
            artifact.cond.notify_all()
    except (OSError, http.client.HTTPException) as exc:
        with artifact.cond:
            artifact.failed = f"{type(exc).__name__}: {exc}"
            if artifact.status is None:
                artifact.status = 502
            artifact.cond.notify_all()


class Relay:
    """The relay of one run (started at the first use, removed by ``close``)."""

    def __init__(self, workdir: str | None = None):
        self.token = secrets.token_hex(8)  # lower-case hex: also a valid registry path component
        self.workdir = workdir
        self._dir: Path | None = None
        self._server = None  # a ThreadingHTTPServer once a role asks for the relay
        self._lock = threading.Lock()
        self._artifacts: dict[tuple, _Artifact] = {}
        self._registries: dict[str, str] = {}  # r<N> -> upstream base URL
        self._upstreams: set[str] = set()  # the URLs the run's roles asked for: no others (no open proxy)
        self.stats = {"upstream_fetches": 0, "upstream_bytes": 0, "served_bytes": 0, "requests": 0}

    # ---- what roles ask for -------------------------------------------------------------
    def port(self) -> int:
        with self._lock:
            if self._server is None:
                from http.server import ThreadingHTTPServer  # only runs that fetch pay for the import
                self._dir = Path(tempfile.mkdtemp(prefix="dgemma-relay-", dir=self.workdir))
                self._server = ThreadingHTTPServer(("0.0.0.0", 0), _handler(self))
                self._server.daemon_threads = True
                threading.Thread(target=self._server.serve_forever, name="relay", daemon=True).start()
            return self._server.server_address[1]

    def url(self, address: str, upstream: str) -> str:
        """The relay's URL for an upstream URL, as a host that reaches ``address`` sees it."""
        encoded = base64.urlsafe_b64encode(upstream.encode()).decode().rstrip("=")
        with self._lock:
            self._upstreams.add(upstream)
        return f"http://{address}:{self.port()}/{self.token}/u/{encoded}"

    def ping_url(self, address: str) -> str:
        return f"http://{address}:{self.port()}/{self.token}/ping"

    def registry_ref(self, address: str, ref: str, scheme: str = "http") -> str | None:
        """``registry[:port]/repo:tag`` through the relay, or None for a reference without a registry."""
        match = re.match(r"^([a-z0-9.-]+(?::[0-9]+)?)/(.+)$", ref)
        if not match or ("." not in match.group(1) and ":" not in match.group(1)):
            return None
        base = f"{scheme}://{match.group(1)}"
        with self._lock:
            name = next((k for k, v in self._registries.items() if v == base), None)
            if name is None:
                name = f"r{len(self._registries)}"
                self._registries[name] = base
        return f"{address}:{self.port()}/{self.token}/{name}/{match.group(2)}"

    # ---- serving ------------------------------------------------------------------------
    def artifact(self, key: tuple, upstream: str, headers: dict) -> _Artifact:
        with self._lock:
            found = self._artifacts.get(key)
            if found is not None and found.failed is None:
                return found
            digest = hashlib.sha256(repr(key).encode()).hexdigest()[:32]
            artifact = _Artifact(self._dir / digest)
            self._artifacts[key] = artifact
        threading.Thread(target=_fetch, args=(artifact, upstream, headers, self.stats, self._lock),
                         name="relay-fetch", daemon=True).start()
        return artifact

    def close(self):
        with self._lock:
            server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def _handler(relay: Relay):
    from http.server import BaseHTTPRequestHandler

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt, *args):
            pass

        def _plain(self, code: int, text: str = "", headers: dict | None = None):
            body = text.encode()
            self.send_response(code)
            for k, v in (headers or {}).items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def do_HEAD(self):
            self.do_GET()

        def do_GET(self):
            with relay._lock:
                relay.stats["requests"] += 1
            parts = self.path.split("?", 1)
            path, query = parts[0], (parts[1] if len(parts) > 1 else "")
            if path == "/v2/" or path == "/v2":  # a registry client's first question
                return self._plain(200, "{}", {"Docker-Distribution-Api-Version": "registry/2.0",
                                               "Content-Type": "application/json"})
            match = re.fullmatch(rf"/{relay.token}/(ping|u/([A-Za-z0-9_-]+))", path)
            registry = re.fullmatch(rf"/v2/{relay.token}/(r[0-9]+)/(.+)/(manifests|blobs)/([^/]+)", path)
            if match and match.group(1) == "ping":
                return self._plain(200, "relay\n")
            # a registry client sends one Accept header per media type (an OCI index among them):
            # all of them go up, or a multi-arch image's index is refused (404 "manifest unknown")
            headers = {k: ", ".join(self.headers.get_all(k)) for k in PASSED_UP if self.headers.get(k)}
            auth = hashlib.sha256((headers.get("Authorization") or "").encode()).hexdigest()
            if match:
                encoded = match.group(2)
                try:
                    upstream = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode()
                except ValueError:
                    upstream = ""
                if upstream not in relay._upstreams:
                    return self._plain(404, "not a relay path\n")
                key = ("u", upstream, auth)
            elif registry and registry.group(1) in relay._registries:
                base = relay._registries[registry.group(1)]
                upstream = f"{base}/v2/{registry.group(2)}/{registry.group(3)}/{registry.group(4)}" + \
                    (f"?{query}" if query else "")
                # a blob is its digest, whoever asks; a manifest depends on what the client accepts
                key = ("blob", upstream) if registry.group(3) == "blobs" else \
                    ("manifest", upstream, headers.get("Accept", ""), auth)
            else:
                return self._plain(404, "not a relay path\n")
            artifact = relay.artifact(key, upstream, headers)
            self._serve(artifact)

        def _serve(self, artifact: _Artifact):
            with artifact.cond:
                while artifact.status is None:
                    artifact.cond.wait(1)
            if artifact.status != 200:
                with artifact.cond:
                    while not artifact.done and artifact.failed is None:
                        artifact.cond.wait(1)
                return self._plain(artifact.status, artifact.body.decode(errors="replace") or
                                   (artifact.failed or ""), artifact.headers)
            with artifact.cond:
                while artifact.size is None and artifact.failed is None:
                    artifact.cond.wait(1)
            if artifact.failed is not None:
                return self._plain(502, artifact.failed)
            size = artifact.size
            start, end, code = 0, size - 1, 200
            wanted = self.headers.get("Range")
            if wanted:
                # one range from an offset, as curl -C and registry clients ask; anything else: 416
                asked = re.fullmatch(r"bytes=([0-9]{1,19})-([0-9]{0,19})", wanted.strip())
                if asked:
                    start = int(asked.group(1))
                    end = min(int(asked.group(2)), size - 1) if asked.group(2) else size - 1
                    code = 206
                if not asked or start > end:
                    return self._plain(416, "", {"Content-Range": f"bytes */{size}"})
            self.send_response(code)
            for k, v in artifact.headers.items():
                self.send_header(k, v)
            self.send_header("Content-Length", str(max(end + 1 - start, 0)))
            if code == 206:
                self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
            self.end_headers()
            if self.command == "HEAD":
                return
            position = start
            with open(artifact.path, "rb") as source:
                while position <= end:
                    with artifact.cond:
                        while artifact.have <= position and artifact.failed is None:
                            artifact.cond.wait(1)
                        if artifact.failed is not None and artifact.have <= position:
                            return  # the client sees a short body and resumes later
                        upto = min(artifact.have, end + 1)
                    try:
                        sent = os.sendfile(self.wfile.fileno(), source.fileno(), position, upto - position)
                    except OSError:
                        return
                    if sent <= 0:
                        return
                    position += sent
                    with relay._lock:
                        relay.stats["served_bytes"] += sent

    return Handler


class RelayView:
    """The run's relay as one host's roles see it: URLs from where that host stands
    (``address``: the control machine's address on the host's side of its SSH link)."""

    def __init__(self, relay: Relay, address: str):
        self.relay = relay
        self.address = address

    def url(self, upstream: str) -> str:
        return self.relay.url(self.address, upstream)

    def ping_url(self) -> str:
        return self.relay.ping_url(self.address)

    def registry_ref(self, ref: str) -> str | None:
        return self.relay.registry_ref(self.address, ref)
