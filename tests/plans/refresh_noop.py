"""After a change to a proxy's template: the no-op cases' captured configuration (and
the generation the instance answers as) made what the template now renders, so that
they stay no-ops. ``python -m tests.plans.refresh_noop``, then ``PLAN_CASES_WRITE=1``
for their steps; read the diff before committing."""
from __future__ import annotations

import hashlib
import json

from tests import plans

CASES = {"frontdoor/noop-rtx01.json": "frontdoor", "gateway/noop-gateway01.json": "gateway"}


def refresh(relative: str, prefix: str):
    path = plans.HERE / "cases" / relative
    raw = json.loads(path.read_text())
    for _ in range(3):  # the generation is in the configuration: once more after it moves
        wanted = [s for s in plans.plan(plans.load(path)) if s.get("needed") and s.get("file", "").endswith("configuration")]
        if not wanted:
            return
        text = "\n".join(wanted[0]["content"]) + "\n"
        raw["facts_changes"][f"{prefix}_config"]["value"].update(
            content=text, sha256=hashlib.sha256(text.encode()).hexdigest(), size=len(text.encode()))
        generation = next(line for line in wanted[0]["content"] if "X-Frontdoor-Generation" in line).split()[-1]
        raw["facts_changes"][f"{prefix}_served"] = {"__replace__": True, "value": generation}
        path.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"{relative}: configuration and generation {generation}")


if __name__ == "__main__":
    for case, kind in CASES.items():
        refresh(case, kind)
