"""Each role's plan from fact files: facts in, steps out (tests/plans/__init__.py).
``PLAN_CASES_WRITE=1`` rewrites the cases' ``steps`` from the code, to be read
before committing."""
import json
import os
from pathlib import Path

import pytest

from tests import plans

CASES = sorted((plans.HERE / "cases").glob("*/*.json"))


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_plan(path: Path):
    case = plans.load(path)
    assert case["role"] == path.parent.name
    got = plans.plan(case)
    if os.environ.get("PLAN_CASES_WRITE"):
        raw = json.loads(path.read_text())
        raw["steps"] = got
        path.write_text(json.dumps(raw, indent=1) + "\n")
    assert got == case["steps"]
    if path.stem.startswith("noop"):  # a host already right: nothing to change
        assert not [s for s in got if s.get("needed") or s.get("ok") is False], "a no-op case plans a change"


def test_every_role_has_a_noop_case_and_a_change_case():
    import roles
    for role in roles.ORDER:
        names = [p.stem for p in CASES if p.parent.name == role]
        assert any(n.startswith("noop") for n in names), f"{role}: no no-op case"
        assert any(not n.startswith("noop") for n in names), f"{role}: no case that changes something"
