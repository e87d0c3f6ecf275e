"""The lab's model hub: the endpoints `hf download` uses (LAB-NOTES.md), serving
the synthetic repo of hubdata.py under any ``org/name``.

Run as ``python3 -m lab.hub ADDRESS PORT``.
"""
from __future__ import annotations

import json
import re
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote

from . import hubdata

REPO = r"(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*)"


class Hub(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt, *args):
        sys.stderr.write("%s %s\n" % (self.address_string(), fmt % args))

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

    def _missing(self, what):
        self._json({"error": f"{what} not found"}, 404, [("X-Error-Code", "EntryNotFound")])

    def do_HEAD(self):
        self.do_GET()

    def do_GET(self):
        path = unquote(self.path.split("?")[0])
        m = re.fullmatch(rf"/api/models/{REPO}(?:/revision/(?P<rev>[^/]+))?", path)
        if m:
            repo = m.group("repo")
            files = hubdata.repo_files(repo)
            return self._json({"id": repo, "modelId": repo, "sha": hubdata.commit(repo), "private": False,
                               "gated": False, "disabled": False, "tags": ["diffusion_gemma"],
                               "siblings": [{"rfilename": f.path} for f in files]})
        m = re.fullmatch(rf"/api/models/{REPO}/tree/(?P<rev>[^/]+)(?:/(?P<sub>.*))?", path)
        if m:
            out = []
            for f in hubdata.repo_files(m.group("repo")):
                entry = {"type": "file", "path": f.path, "size": len(f.data), "oid": f.git_oid}
                if f.lfs:
                    entry["lfs"] = {"oid": f.sha256, "size": len(f.data), "pointerSize": 134}
                out.append(entry)
            return self._json(out)
        m = re.fullmatch(rf"/{REPO}/resolve/(?P<rev>[^/]+)/(?P<file>.+)", path)
        if m:
            repo = m.group("repo")
            for f in hubdata.repo_files(repo):
                if f.path == m.group("file"):
                    return self._file(repo, f)
            return self._missing(m.group("file"))
        self._missing(path)

    def _file(self, repo, f):
        data = f.data
        start, end = 0, len(data) - 1
        rng = self.headers.get("Range")
        code = 200
        if rng and rng.startswith("bytes="):
            first, _, last = rng[6:].partition("-")
            start = int(first or 0)
            end = int(last) if last else len(data) - 1
            code = 206
        body = data[start:end + 1]
        self.send_response(code)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("X-Repo-Commit", hubdata.commit(repo))
        self.send_header("ETag", f'"{f.etag}"')
        self.send_header("Accept-Ranges", "bytes")
        if f.lfs:
            self.send_header("X-Linked-Etag", f'"{f.sha256}"')
            self.send_header("X-Linked-Size", str(len(data)))
        if code == 206:
            self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


def main(argv):
    address, port = argv[0], int(argv[1])  # argv[2] names the lab in ps
    server = ThreadingHTTPServer((address, port), Hub)
    server.daemon_threads = True
    print(f"hub on http://{address}:{port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main(sys.argv[1:])
