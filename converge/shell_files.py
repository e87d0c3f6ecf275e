"""The engine's shell files as it sends them to a host (its host scripts, its facts' libraries):
without their comment lines and blank lines. Every run carries them, the lock's and the facts'
often as the exec request's command line, and a no-op run is little more than that one round
trip; the comments stay in the files, for the people and shellcheck who read them there."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=None)
def as_sent(path: Path) -> str:
    return "".join(line for line in path.read_text().splitlines(keepends=True)
                   if line.strip() and not line.lstrip().startswith("#"))
