"""Each role's plan from fact files: facts in, steps out, through the runner's own step
executor (tests/plans/__init__.py). ``PLAN_CASES_WRITE=1`` rewrites the cases' ``steps``
and their snapshots from the code, to be read before committing."""
import json
import os
from pathlib import Path

import pytest

from tests import plans

CASES = sorted((plans.HERE / "cases").glob("*/*.json"))
LARGEST_CASE = 8 * 1024  # a case states intent; the scripts and files are in its snapshot


def snapshot_of(path: Path) -> Path:
    return plans.HERE / "snapshots" / path.parent.name / f"{path.stem}.txt"


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_plan(path: Path):
    case = plans.load(path)
    assert case["role"] == path.parent.name
    got, snapshot = plans.plan(case)
    shot = snapshot_of(path)
    if os.environ.get("PLAN_CASES_WRITE"):
        raw = json.loads(path.read_text())
        raw["steps"] = got
        path.write_text(json.dumps(raw, indent=1) + "\n")
        shot.parent.mkdir(parents=True, exist_ok=True)
        if snapshot:
            shot.write_text(snapshot)
        elif shot.exists():
            shot.unlink()
    assert got == case["steps"]
    assert snapshot == (shot.read_text() if shot.exists() else "")
    assert len(path.read_bytes()) < LARGEST_CASE, f"{path.name}: keep the case's bulk in its facts or snapshot"
    if path.stem.startswith("noop"):  # a host already right: nothing to change
        assert not [s for s in got if s.get("status") in ("changed", "failed") or "stopped" in s or "failed" in s], \
            "a no-op case plans a change"


def test_every_role_has_a_noop_case_and_a_change_case():
    import roles
    for role in roles.ORDER:
        names = [p.stem for p in CASES if p.parent.name == role]
        assert any(n.startswith("noop") for n in names), f"{role}: no no-op case"
        assert any(not n.startswith("noop") for n in names), f"{role}: no case that changes something"


def test_no_snapshot_is_left_without_its_case():
    shots = sorted((plans.HERE / "snapshots").glob("*/*.txt"))
    assert [s for s in shots if not (plans.HERE / "cases" / s.parent.name / f"{s.stem}.json").exists()] == []
