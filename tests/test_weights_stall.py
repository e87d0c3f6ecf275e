"""A weights download whose server stops sending mid-blob (roles/weights/download.py, run
by sh (dash) here against a local server): each try gives up after ``download_stall_s`` without
a byte, keeps what came, and the next try resumes from there."""
import hashlib
import json
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from roles.weights.download import HubFile, Manifest, fetch_script, manifest_script, parse_manifest

BLOB = bytes(range(256)) * 4096  # 1 MiB
SENT_BEFORE_STALL = 300_000


class Stalling(BaseHTTPRequestHandler):
    def do_GET(self):
        start = int((self.headers.get("Range") or "bytes=0-").split("=")[1].split("-")[0])
        self.server.ranges.append(start)
        self.send_response(206 if start else 200)
        if start:
            self.send_header("Content-Range", f"bytes {start}-{len(BLOB) - 1}/{len(BLOB)}")
        self.send_header("Content-Length", str(len(BLOB) - start))
        self.end_headers()
        # the first answer stops after some bytes and holds the connection open, sending
        # nothing; later ones send the rest
        if len(self.server.ranges) == 1:
            self.wfile.write(BLOB[start:SENT_BEFORE_STALL])
            self.wfile.flush()
            time.sleep(30)
            return
        self.wfile.write(BLOB[start:])

    def log_message(self, *args):
        pass


def test_a_stalled_blob_is_given_up_after_download_stall_s_and_resumed(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), Stalling)
    server.ranges, server.daemon_threads = [], True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    blob = hashlib.sha256(BLOB).hexdigest()
    # a second path to the same blob, with a blank in it: linked, not fetched again
    manifest = Manifest("org/model", "main", "c" * 40, (HubFile("model.safetensors", len(BLOB), blob, True),
                                                         HubFile("copies/a b.bin", len(BLOB), blob, True)))
    script = fetch_script(str(tmp_path), manifest, f"http://127.0.0.1:{server.server_address[1]}", None, stall_s=3)
    started = time.monotonic()
    try:
        out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    took = time.monotonic() - started
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the first try gave up after 3 s without a byte (not curl's 20 s default), kept its part,
    # and the second asked for the rest alone
    assert "STALL_S=3\n" in script and 3 <= took < 15, (took, out.stdout[-1000:])
    assert server.ranges == [0, SENT_BEFORE_STALL], server.ranges
    assert f"@partial {blob} {SENT_BEFORE_STALL} {len(BLOB)} 28 " in out.stdout  # 28: curl's timeout
    stored = tmp_path / "hub" / "models--org--model" / "blobs" / blob
    assert stored.read_bytes() == BLOB
    snapshot = tmp_path / "hub" / "models--org--model" / "snapshots" / ("c" * 40)
    assert (snapshot / "copies" / "a b.bin").read_bytes() == BLOB and (snapshot / "model.safetensors").is_symlink()
    assert (tmp_path / "hub" / "models--org--model" / "refs" / "main").read_text() == "c" * 40
    from roles.weights.download import FETCH
    assert out.stdout.splitlines()[-1].startswith("@result ")  # how it ended, last
    said = FETCH.result_of(out.stdout)
    assert (said["outcome"], said["commit"], said["need"]) == ("complete", "c" * 40, len(BLOB) * 2)


class Hub(BaseHTTPRequestHandler):
    """The hub's API for one model: its revision, then its file tree in two pages (Link: next)."""
    def do_GET(self):
        self.server.auth.append(self.headers.get("Authorization"))
        commit = "d" * 40
        if "/revision/" in self.path:
            body, link = json.dumps({"sha": commit}), None
        elif "page=2" in self.path:
            body, link = json.dumps([{"type": "file", "path": "dir/a b.json", "size": 3, "oid": "e" * 40}]), None
        else:
            body = json.dumps([{"type": "file", "path": "model.safetensors", "size": 5,
                                "lfs": {"oid": "f" * 64, "size": 5}}])
            link = f"<http://127.0.0.1:{self.server.server_address[1]}/api/models/org/model/tree/{commit}?page=2>"
        self.send_response(200)
        if link:
            self.send_header("Link", f'{link}; rel="next"')
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


def test_the_manifest_pages_through_the_tree_with_the_token_on_curls_stdin_alone():
    """files/manifest.sh under sh: the revision's commit, both pages of its tree (a path with a
    blank in it), the token sent as the header and written nowhere in the script."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    server.auth, server.daemon_threads = [], True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    token = "hf_Secret123"
    script = manifest_script(endpoint, "org/model", "main", token)
    try:
        out = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    assert token not in script and out.returncode == 0, out.stderr
    assert server.auth == [f"Bearer {token}"] * 3
    manifest = parse_manifest(out.stdout, "org/model", "main", endpoint)
    assert (manifest.commit, [f.path for f in manifest.files]) == ("d" * 40, ["model.safetensors", "dir/a b.json"])
