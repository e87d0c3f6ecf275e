"""What crossed the lab's uplink, from the hub's and the registry's own access logs.

Read from a mark taken before a run: ``mark()`` then ``since(mark)``. The hub logs a
JSON line per request (lab/hub.py); the registry (Distribution) logs one line per
request in the combined format, every request reaching it through the uplink.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field

from . import config
from .services import HUB_LOG

REGISTRY_LOG = config.STATE / "registry.log"
REGISTRY_GET = re.compile(r'"GET /v2/(?P<repo>[^ ]+)/blobs/(?P<digest>sha256:[0-9a-f]{64}) HTTP/[0-9.]+" '
                          r'(?P<status>\d{3}) (?P<bytes>\d+)')
HUB_FILE = re.compile(r"^/(?P<repo>[^/]+/[^/]+)/resolve/(?P<commit>[0-9a-f]{40})/(?P<path>.+)$")


@dataclass
class Crossings:
    """Full or partial GETs of each hub file ({(repo, path): n}) and registry blob ({digest: n})."""

    hub_files: Counter = field(default_factory=Counter)
    hub_bytes: int = 0
    registry_blobs: Counter = field(default_factory=Counter)
    registry_bytes: int = 0


def _size(path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def mark() -> tuple[int, int]:
    return _size(HUB_LOG), _size(REGISTRY_LOG)


def _lines(path, offset: int):
    try:
        with open(path, "rb") as handle:
            handle.seek(offset)
            return handle.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def since(start: tuple[int, int]) -> Crossings:
    seen = Crossings()
    for line in _lines(HUB_LOG, start[0]):
        try:
            entry = json.loads(line)
        except ValueError:
            continue
        seen.hub_bytes += int(entry.get("bytes") or 0)
        found = HUB_FILE.match(entry.get("path", ""))
        if found and entry.get("method") == "GET" and entry.get("status") in (200, 206):
            seen.hub_files[(found["repo"], found["path"])] += 1
    for line in _lines(REGISTRY_LOG, start[1]):
        found = REGISTRY_GET.search(line)
        if found and found["status"] in ("200", "206"):
            seen.registry_blobs[found["digest"]] += 1
            seen.registry_bytes += int(found["bytes"])
    return seen
