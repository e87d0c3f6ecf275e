"""Reading a Hugging Face cache on a host: the fact (its program, files/cache.sh), and pure checks.

Complete means: ``refs/<revision>`` names a commit, its snapshot holds every
file (symlinks that resolve), no ``.incomplete`` blob, and every LFS blob's
sha256 equals its name. Hashing 18-49 GB on every run would make a no-op slow,
so the weights role hashes each blob as it arrives and records its name, size
and mtime in ``.dgemma-verified``; the fact compares against that record.
"""
from __future__ import annotations

from pathlib import Path

from converge.facts import Fact

from serving.hf_cache import model_of, repo_dir, status  # noqa: F401  (the weights role's names for them)
from serving.host_programs import Program, Protocol

VERIFIED = ".dgemma-verified"


CACHE = Protocol("the Hugging Face cache", markers={
    "repo": "DIR: a model's folder (models--ORG--NAME); what follows is its own",
    "ref": "NAME COMMIT", "snapshot": "COMMIT FILES BROKEN (files that point at no blob)",
    "blob": "NAME SIZE MTIME", "verified": "NAME SIZE MTIME: a blob the weights role hashed"})
CACHE_PROGRAM = Program((Path(__file__).parent / "files" / "cache.sh",), CACHE)


class HfCache(Fact):
    """Every model in ``<cache>/hub``: refs, snapshot, blobs and the verification record."""

    def __init__(self, cache: str):
        self.command = CACHE_PROGRAM.script({"HUB": cache.rstrip("/") + "/hub", "VERIFIED": VERIFIED})

    def process(self, output, rc):
        return parse_cache(output)


def parse_cache(text: str) -> dict:
    models: dict = {}
    current = None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "@repo":
            name = model_of(rest)
            current = models[name] = {"refs": {}, "snapshots": {}, "blobs": {}, "verified": set()}
        elif current is None:
            continue
        elif kind == "@ref":
            ref, _, commit = rest.partition(" ")
            current["refs"][ref] = commit.strip()
        elif kind == "@snapshot":
            commit, files, broken = rest.split()
            current["snapshots"][commit] = {"files": int(files), "broken": int(broken)}
        elif kind == "@blob":
            name, size, mtime = rest.split()
            current["blobs"][name] = (int(size), int(mtime))
        elif kind == "@verified":
            current["verified"].add(tuple(rest.split()))
    return models
