"""Where a model lives in a Hugging Face cache (the layout ``hf`` and vLLM read): its folder
``hub/models--ORG--NAME``, its ``refs/<revision>`` naming a commit, ``snapshots/<commit>``
linking into ``blobs/``. Shared by the weights role, the release history and prune. Pure."""
from __future__ import annotations

import re

SHA256 = re.compile(r"^[0-9a-f]{64}$")


def repo_dir(model: str) -> str:
    return "models--" + model.replace("/", "--")


def model_of(folder: str) -> str | None:
    """``models--ORG--NAME`` -> ``ORG/NAME`` (None: not a model's folder)."""
    if not folder.startswith("models--"):
        return None
    return folder[len("models--"):].replace("--", "/", 1)


def model_path(cache: str, model: str) -> str:
    return f"{cache.rstrip('/')}/hub/{repo_dir(model)}"


def ref_path(cache: str, model: str, revision: str) -> str:
    return f"{model_path(cache, model)}/refs/{revision}"


def status(models: dict, model: str, revision: str = "main") -> tuple[bool, str]:
    """(complete, why not) for one model of a cache as the weights role's fact reads it (roles/weights/cache.py)."""
    entry = models.get(model)
    if not entry:
        return False, "not in the cache"
    commit = entry["refs"].get(revision) or (revision if revision in entry["snapshots"] else None)
    if not commit:
        return False, f"no refs/{revision}"
    snap = entry["snapshots"].get(commit)
    if not snap or snap["files"] == 0:
        return False, f"no snapshot for {commit[:12]}"
    if snap["broken"]:
        return False, f"{snap['broken']} snapshot files point at missing blobs"
    incomplete = [b for b in entry["blobs"] if b.endswith(".incomplete")]
    if incomplete:
        return False, f"{len(incomplete)} partial downloads (.incomplete)"
    recorded = {(name, size, mtime) for name, size, mtime in entry["verified"]}
    for name, (size, mtime) in entry["blobs"].items():
        if SHA256.match(name) and (name, str(size), str(mtime)) not in recorded:
            return False, f"blob {name[:12]} not verified"
    return True, f"{commit[:12]}, {len(entry['blobs'])} blobs verified"
