"""What was deployed on a host, remembered there: its release history.

Each deploy that leaves a replica serving something new (another image, by digest, or other
weights, by commit) appends a line to ``/var/lib/dgemma/<service>.releases`` once the replica
has passed its gate (roles/start, files/record_release.sh): a release that failed its gate and
went back is never recorded. A line is one JSON object: the replica's unit, the image
reference and its registry digest, the model, the revision asked for and the commit it named,
and when. The file is the host's own memory: ``invoke prune`` keeps the releases it names,
``invoke status`` shows each replica's rollback target from it. Pure."""
from __future__ import annotations

import json
from dataclasses import dataclass

from serving.replicas import service
from serving.serving_host import STATE_DIR

KEPT_LINES = 500  # the file keeps its newest lines: years of weekly deploys of a few replicas
# a release's fields as they appear in a line (the program writes them in this order)
FIELDS = ("unit", "image", "digest", "model", "revision", "commit", "at")


def history_path(v: dict) -> str:
    return f"{STATE_DIR}/{service(v)}.releases"


@dataclass(frozen=True)
class Release:
    unit: str
    image: str
    digest: str  # the registry's digest of the image (empty: none known)
    model: str
    revision: str
    commit: str  # the commit the revision named (empty: not known)
    at: str  # UTC, ISO 8601

    @property
    def artifacts(self) -> tuple:
        """What a rollback to it needs on the disk: its image and its weights."""
        return (self.image, self.digest, self.model, self.commit)

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in FIELDS}


def parse_history(text: str) -> list[Release]:
    """The releases of a history file, oldest first; a line that is not one (a file cut by a full
    disk before the atomic write existed, an edit by hand) is left out."""
    found = []
    for line in text.splitlines():
        try:
            data = json.loads(line)
        except ValueError:
            continue
        if isinstance(data, dict) and all(isinstance(data.get(name), str) for name in FIELDS):
            found.append(Release(**{name: data[name] for name in FIELDS}))
    return found


def current(releases: list[Release]) -> dict[str, Release]:
    """Each unit's newest release: what it runs (unit -> release)."""
    return {r.unit: r for r in releases}


def rollback_target(releases: list[Release], unit: str) -> Release | None:
    """What the unit ran before its current release: the newest earlier release of the unit that
    differs from it."""
    mine = [r for r in releases if r.unit == unit]
    if not mine:
        return None
    now = mine[-1].artifacts
    for release in reversed(mine[:-1]):
        if release.artifacts != now:
            return release
    return None


def kept(releases: list[Release], keep: int) -> list[Release]:
    """The releases prune keeps: each unit's current one, and the ``keep`` newest releases of the
    host before those that are not current (the rollback targets: keep 1 keeps the last one)."""
    now = current(releases)
    running = {r.artifacts for r in now.values()}
    out = list(now.values())
    earlier: list[tuple] = []
    for release in reversed(releases):
        if release.artifacts in running or release.artifacts in earlier:
            continue
        if len(earlier) >= keep:
            break
        earlier.append(release.artifacts)
        out.append(release)
    return out
