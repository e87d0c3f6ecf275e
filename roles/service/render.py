"""`invoke render`: the unit (``systemd``) or the NixOS module (``nixos``) that
the service role would write for a host, for people who manage the host
themselves. Runs after the preflight choice (image, model, memory), changes nothing."""
from __future__ import annotations

from converge.changes import Role

from .nixos import module_path
from .role import read_secret, render_module, render_unit, unit_path

FORMATS = ("systemd", "nixos")


def _summary(ctx) -> dict:
    d, v = ctx.desired, ctx.vars
    if "model" not in d:
        return {}  # the preflight choice failed: the report says why
    has_token = bool(read_secret(v.get("hf_token_file"), "hf_token_file", ctx.name))
    args = (v, d["image"], d["model"], d["utilization"], has_token, d.get("gpus"), d.get("tensor_parallel_size", 1))
    return {"render": {"systemd": (unit_path(v), render_unit(*args)),
                       "nixos": (module_path(v), render_module(*args))}}


RENDER_ROLE = Role("render", lambda v: {}, lambda ctx: iter(()), summary=_summary)
