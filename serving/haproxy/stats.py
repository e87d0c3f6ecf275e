"""What an HAProxy instance says of its servers, from its stats page (CSV) on the
unix socket only root reaches: a fact (a command and a pure ``process``)."""
from __future__ import annotations

import csv
import io
from pathlib import Path

from converge.facts import Fact, call

# the backends of a model family's pool, front door and gateway alike (templates/haproxy.cfg.j2):
# a front door's pool servers track its replicas', a gateway's are the front doors
POOL_PREFIX = "pool_"


def stats_rows(text: str) -> list[dict]:
    """Every row of HAProxy's stats CSV (``/stats;csv``): frontends, backends and servers."""
    return list(csv.DictReader(io.StringIO(text.lstrip("# "))))


def server_rows(text: str, backend: str = "servers") -> list[dict]:
    """The rows of HAProxy's stats CSV (``/stats;csv``) for each server of ``backend`` (of every
    backend whose name starts with it, when it ends in ``_``: the gateway's pools)."""
    def wanted(name):
        return name is not None and (name.startswith(backend) if backend.endswith("_") else name == backend)
    return [row for row in stats_rows(text)
            if wanted(row.get("pxname")) and row.get("svname") not in (None, "FRONTEND", "BACKEND")]


class ServerStates(Fact):
    """``{server: {"status": "UP"|"DRAIN"|"DOWN"|..., "in_flight": n}}`` of one backend
    (empty when the instance does not answer: not running, or older than its admin socket)."""

    def __init__(self, socket: str, backend: str = "servers"):
        self.backend = backend
        self.library, self.command = Path(__file__).parent / "files" / "facts.sh", call("fact_server_states", socket)

    def process(self, output, rc):
        # a server's requests also go through the backends whose servers track it (a front
        # door's pool_<family>): they count as its own
        tracking = {}
        for row in server_rows(output, POOL_PREFIX):
            tracking[row["svname"]] = tracking.get(row["svname"], 0) + _in_flight(row)
        return {row["svname"]: {"status": row.get("status", ""),
                                 "in_flight": _in_flight(row) + tracking.get(row["svname"], 0)}
                for row in server_rows(output, self.backend)}


def _in_flight(row: dict) -> int:
    return int(row.get("scur") or 0) + int(row.get("qcur") or 0)
