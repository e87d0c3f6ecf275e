"""What a run of the facts role (roles/preflight, read-only) hands the render: each serving
host's variables, hardware and the SSH deploy's choice for it."""
from __future__ import annotations

from pathlib import Path

import yaml

from converge.changes import Role
from serving.fleet import is_serving
from serving.handoffs import CHOICE

from .serving import ServingHost

SCHEMA = Path(__file__).parent / "schema.yml"


def schema() -> dict:
    """The inventory variable ``kubernetes`` (beside the roles' own, for the inventory's check)."""
    return yaml.safe_load(SCHEMA.read_text())


def _summary(ctx) -> dict:
    choice, f = ctx.results.get(CHOICE), ctx.facts
    if choice is None or f is None:
        return {}  # the facts role failed: the report says why
    nvidia = f.get("nvidia") or {}
    return {"kubernetes": ServingHost(ctx.name, dict(ctx.vars), f.get("arch"), nvidia.get("cuda_version"),
                                      tuple(nvidia.get("gpus") or ()), choice)}


KUBERNETES_ROLE = Role("kubernetes", lambda v: {}, lambda ctx: iter(()), summary=_summary, hosts=is_serving)
