"""A webhook receiver on the control machine for the lab tests of alerting: it records
each notification Alertmanager posts (its alerts, with their status, labels and
annotations) when it brings the token of the receiver's bearer_token_file."""
from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Receiver(BaseHTTPRequestHandler):
    def do_POST(self):
        body = self.rfile.read(int(self.headers.get("content-length") or 0))
        ok = self.headers.get("authorization") == f"Bearer {self.server.token}"
        if ok:
            try:
                notification = json.loads(body)
            except ValueError:
                notification = {}
            with self.server.lock:
                for alert in notification.get("alerts") or []:
                    self.server.alerts.append({"at": time.time(), "status": alert.get("status"),
                                               "labels": alert.get("labels") or {},
                                               "annotations": alert.get("annotations") or {}})
        else:
            self.server.refused += 1
        self.send_response(200 if ok else 401)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def serve(address: str, token: str) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((address, 0), Receiver)
    server.token, server.alerts, server.refused, server.lock = token, [], 0, threading.Lock()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def wait_for(receiver, status: str, limit: float, **labels) -> dict:
    """The first notification of an alert with this status whose labels include ``labels``."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        with receiver.lock:
            for alert in receiver.alerts:
                if alert["status"] == status and all(alert["labels"].get(k) == v for k, v in labels.items()):
                    return alert
        time.sleep(0.5)
    with receiver.lock:
        seen = [(a["status"], a["labels"].get("alertname"), a["labels"].get("host"), a["labels"].get("replica"),
                 a["labels"].get("server")) for a in receiver.alerts]
    raise AssertionError(f"no {status} notification of {labels} within {limit:.0f} s; received: {seen}")
