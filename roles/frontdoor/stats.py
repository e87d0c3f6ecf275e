"""What an HAProxy instance says of its servers, from its stats page (CSV) on the
unix socket only root reaches: a fact (a command and a pure ``process``)."""
from __future__ import annotations

import csv
import io
import shlex

from converge.facts import Fact


class ServerStates(Fact):
    """``{server: {"status": "UP"|"DRAIN"|"DOWN"|..., "in_flight": n}}`` of one backend
    (empty when the instance does not answer: not running, or older than its admin socket)."""

    def __init__(self, socket: str, backend: str = "servers"):
        self.backend = backend
        self.command = (f"[ -S {shlex.quote(socket)} ] && curl -sS --max-time 2 --unix-socket {shlex.quote(socket)} "
                        f"'http://proxy/;csv' 2>/dev/null; true")

    def process(self, output, rc):
        states = {}
        for row in csv.DictReader(io.StringIO(output.lstrip("# "))):
            if row.get("pxname") == self.backend and row.get("svname") not in (None, "FRONTEND", "BACKEND"):
                states[row["svname"]] = {"status": row.get("status", ""),
                                         "in_flight": int(row.get("scur") or 0) + int(row.get("qcur") or 0)}
        return states
