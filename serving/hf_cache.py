"""Where a model lives in a Hugging Face cache (the layout ``hf`` and vLLM read): its folder
``hub/models--ORG--NAME``, its ``refs/<revision>`` naming a commit, ``snapshots/<commit>``
linking into ``blobs/``. Shared by the weights role, the release history and prune. Pure."""
from __future__ import annotations


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
