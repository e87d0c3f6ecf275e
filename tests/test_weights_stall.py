"""A weights download whose server stops sending mid-blob (roles/weights/download.py, run
by bash here against a local server): each try gives up after ``download_stall_s`` without
a byte, keeps what came, and the next try resumes from there."""
import hashlib
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from roles.weights.download import HubFile, Manifest, fetch_script

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
    manifest = Manifest("org/model", "main", "c" * 40, (HubFile("model.safetensors", len(BLOB), blob, True),))
    script = fetch_script(str(tmp_path), manifest, f"http://127.0.0.1:{server.server_address[1]}", None, stall_s=3)
    started = time.monotonic()
    try:
        out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
        server.server_close()
    took = time.monotonic() - started
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    # the first try gave up after 3 s without a byte (not curl's 20 s default), kept its part,
    # and the second asked for the rest alone
    assert "--speed-time 3" in script and 3 <= took < 15, (took, out.stdout[-1000:])
    assert server.ranges == [0, SENT_BEFORE_STALL], server.ranges
    assert f"@partial {blob} {SENT_BEFORE_STALL} {len(BLOB)} 28 " in out.stdout  # 28: curl's timeout
    stored = tmp_path / "hub" / "models--org--model" / "blobs" / blob
    assert stored.read_bytes() == BLOB
