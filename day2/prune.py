"""`invoke prune`: the fleet's old images and weights removed on each serving host, the rollback
target kept (serving/prune.py says what goes and how)."""
from __future__ import annotations

from converge.changes import Command, Role
from converge.errors import StepFailed

from serving.fleet import is_serving
from serving.prune import DEFAULT_KEEP, disk_textfile_step, prune_facts, removal_commands, selection


def prune_role(keep: int = DEFAULT_KEEP) -> Role:
    def plan(ctx):
        chosen = selection(ctx, keep)
        if not chosen.remove:
            yield Command("prune", when=False, describe="nothing to remove: every image and snapshot of the fleet "
                                                       "here is running or kept")
            return
        yield from removal_commands(ctx, chosen)
        # the fleet's disk as monitoring sees it, once every removal is done (keep 1: what deploy writes)
        if keep == DEFAULT_KEEP:
            yield disk_textfile_step(ctx, chosen, removed=True)

    def summary(ctx):
        if ctx.facts is None:
            return {}
        try:
            chosen = selection(ctx, keep)
        except StepFailed as exc:
            return {"prune": {"error": str(exc)}}
        return {"prune": {"keep": keep, "remove": [r.as_dict() for r in chosen.remove],
                          "frees": sum(r.frees for r in chosen.remove),
                          "kept": [{"what": what, "why": why} for what, why in chosen.keep]}}

    return Role("prune", prune_facts, plan, summary=summary, hosts=is_serving)

