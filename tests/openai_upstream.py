"""An external OpenAI-compatible API for the tests of the gateway's fallback: it records each
request's path and the key it brought (``seen``) and the compression it allowed (``encodings``),
and answers a chat completion when the key is its own (``server.key``; None: any key), gzipped
when the request allows it, as OpenAI's API does."""
from __future__ import annotations

import gzip
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Upstream(BaseHTTPRequestHandler):
    def do_POST(self):
        sent = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        brought = self.headers.get("authorization")
        ok = self.server.key is None or brought == f"Bearer {self.server.key}"
        self.server.seen.append((self.path, brought, ok))
        allowed = self.headers.get("accept-encoding") or ""
        self.server.encodings.append(allowed)
        body = json.dumps({"id": "chatcmpl-upstream", "object": "chat.completion", "model": sent.get("model"),
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": "from the upstream"}}],
                           "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}
                          if ok else {"error": {"message": "bad key", "code": 401}}).encode()
        self.send_response(200 if ok else 401)
        self.send_header("content-type", "application/json")
        if "gzip" in allowed:
            body = gzip.compress(body)
            self.send_header("content-encoding", "gzip")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def serve(address: str, key: str | None = None) -> ThreadingHTTPServer:
    """The API on ``address`` (a free port), answering in a thread; ``shutdown()`` and
    ``server_close()`` it when done."""
    server = ThreadingHTTPServer((address, 0), Upstream)
    server.key, server.seen, server.encodings = key, [], []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server
