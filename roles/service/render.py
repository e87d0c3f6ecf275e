"""`invoke render`: the unit (``systemd``) or the NixOS module (``nixos``) that
the service role would write for a host, for people who manage the host
themselves. Runs after the preflight choice (image, model, memory), changes nothing."""
from __future__ import annotations

from converge.changes import Role

from serving.handoffs import CHOICE
from serving.replicas import Served

from serving.nixos_module import module_path
from .role import read_secret, render_module, render_unit

FORMATS = ("systemd", "nixos")


def _summary(ctx) -> dict:
    v, choice = ctx.vars, ctx.results.get(CHOICE)
    if choice is None:
        return {}  # the preflight choice failed: the report says why
    has_token = bool(read_secret(v.get("hf_token_file"), "hf_token_file", ctx.name))
    served = [Served.of(v, placed) for placed in choice.replicas]
    # a unit per replica; one module declares them all
    return {"render": {"systemd": [(s.replica.unit_path, render_unit(v, choice.image, s, has_token))
                                   for s in served],
                       "nixos": [(module_path(v), render_module(v, choice.image, served, has_token))]}}


RENDER_ROLE = Role("render", lambda v: {}, lambda ctx: iter(()), summary=_summary)
