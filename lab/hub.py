"""The lab's model hub: the endpoints `hf download` uses (LAB-NOTES.md), serving
the synthetic repo of hubdata.py under any ``org/name``.

Knobs (a JSON file, read at every request): ``size_mib`` (the checkpoint's
size), ``corrupt`` (``{"model.safetensors": 1}``: the next GET of that file sends
one wrong byte, as a broken proxy or disk would). Every request is logged as
one JSON line (path, range, status, bytes sent), so tests and the benchmark
can count what crossed.

Run as ``python3 -m lab.hub ADDRESS PORT NAME KNOBS.json ACCESS.log``.
"""
from __future__ import annotations

import json
import re
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote

from . import config, hubdata

REPO = r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"
KNOBS: Path | None = None
LOG: Path | None = None
LOCK = threading.Lock()


def knobs() -> dict:
    try:
        return json.loads(KNOBS.read_text()) if KNOBS else {}
    except (OSError, ValueError):
        return {}


def take_corruption(path: str) -> bool:
    """Whether this GET of ``path`` is one the knobs asked to corrupt (counted down)."""
    with LOCK:
        current = knobs()
        left = int((current.get("corrupt") or {}).get(path, 0))
        if left <= 0:
            return False
        current["corrupt"][path] = left - 1
        KNOBS.write_text(json.dumps(current) + "\n")
        return True


def files(repo: str) -> tuple:
    return hubdata.repo_files(repo, int(knobs().get("size_mib") or hubdata.DEFAULT_MIB), str(config.CACHE / "hub"))


def commit(repo: str) -> str:
    return hubdata.commit(repo, int(knobs().get("size_mib") or hubdata.DEFAULT_MIB), str(config.CACHE / "hub"))


class Hub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

    def _log(self, status: int, sent: int, rng: str | None):
        if LOG is None:
            return
        line = json.dumps({"t": round(time.time(), 3), "client": self.client_address[0], "method": self.command,
                           "path": unquote(self.path.split("?")[0]), "range": rng, "status": status, "bytes": sent})
        with LOCK, open(LOG, "a") as handle:
            handle.write(line + "\n")

    def _json(self, obj, code=200, headers=()):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)
        self._log(code, len(body) if self.command != "HEAD" else 0, None)

    def _missing(self, what):
        self._json({"error": f"{what} not found"}, 404, [("X-Error-Code", "EntryNotFound")])

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = unquote(self.path.split("?")[0])
        m = re.fullmatch(rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", path)
        if m:
            repo = m.group("repo")
            return self._json({"id": repo, "modelId": repo, "sha": commit(repo), "private": False,
                               "gated": False, "disabled": False, "tags": ["diffusion_gemma"],
                               "siblings": [{"rfilename": f.path} for f in files(repo)]})
        m = re.fullmatch(rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?", path)
        if m:
            out = []
            for f in files(m.group("repo")):
                entry = {"type": "file", "path": f.path, "size": f.size, "oid": f.git_oid}
                if f.lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": f.size, "pointerSize": 134}
                out.append(entry)
            return self._json(out)
        m = re.fullmatch(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        if m:
            repo = m.group("repo")
            for f in files(repo):
                if f.path == m.group("file"):
                    return self._file(repo, f)
            return self._missing(m.group("file"))
        self._missing(path)

    def _file(self, repo, f):
        start, end = 0, f.size - 1
        rng = self.headers.get("Range")
        code = 200
        if rng and rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            start = int(first or 0)
            end = min(int(last), f.size - 1) if last else f.size - 1
            code = 206
        if start > end:
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{f.size}")
            self.send_header("Content-Length", "0")
            self.end_headers()
            self._log(416, 0, rng)
            return
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end + 1 - start))
        self.send_header("X-Repo-Commit", commit(repo))
        self.send_header("ETag", f'"{f.etag}"')
        self.send_header("Accept-Ranges", "bytes")
        if f.lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(f.size))
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{f.size}")
        self.end_headers()
        sent = 0
        if self.command != "HEAD":
            corrupt = take_corruption(f.path)
            try:
                for piece in f.chunks(start, end):
                    if corrupt:  # one wrong byte in the first piece: the size is right, the sha256 is not
                        piece = bytes([piece[0] ^ 0xFF]) + piece[1:]
                        corrupt = False
                    self.wfile.write(piece)
                    sent += len(piece)
            except (BrokenPipeError, ConnectionResetError):
                pass
        self._log(code, sent, rng)


def main(argv):
    global KNOBS, LOG
    address, port = argv[0], int(argv[1])  # argv[2] names the lab in ps
    if len(argv) > 4:
        KNOBS, LOG = Path(argv[3]), Path(argv[4])
    server = ThreadingHTTPServer((address, port), Hub)
    server.daemon_threads = True
    print(f"hub on http://{address}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
