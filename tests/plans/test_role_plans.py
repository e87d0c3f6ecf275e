"""Each role's plan from fact files: facts in, steps out, through the runner's own step
executor (tests/plans/__init__.py). ``PLAN_CASES_WRITE=1`` rewrites the snapshots from the
code, to be read before committing."""
import functools
import re
import os
import tempfile
from pathlib import Path

import pytest

from tests import plans

CASES = sorted((plans.HERE / "cases").glob("*/*.json"))
LARGEST_CASE = 8 * 1024  # a case states intent; the scripts and files are in its snapshot
# the cases, their roles' defaults and their snapshots together: a case whose snapshot grows past
# this holds a program's body or a text already shown (see tests/plans/__init__.py). The gateway's
# configuration is the largest text shown: its rules reserve the token budgets (docs/accounting.md)
LARGEST_PLANS = 265 * 1000


def snapshot_of(path: Path) -> Path:
    return plans.HERE / "snapshots" / path.parent.name / f"{path.stem}.txt"


@functools.lru_cache(maxsize=None)
def steps_of(path: Path) -> tuple:
    return tuple(plans.taken(plans.load(path)))


def earlier_of(path: Path) -> tuple:
    """The role's cases before this one, with their texts: its snapshot shows a text the same as, or as
    a diff from, one of theirs."""
    return tuple((p.stem, steps_of(p)) for p in CASES if p.parent == path.parent and p.stem < path.stem)


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_plan(path: Path):
    case = plans.load(path)
    assert case["role"] == path.parent.name
    got, snapshot = plans.plan(case, earlier_of(path))
    shot = snapshot_of(path)
    if os.environ.get("PLAN_CASES_WRITE"):
        shot.parent.mkdir(parents=True, exist_ok=True)
        shot.write_text(snapshot)
    assert snapshot == (shot.read_text() if shot.exists() else "")
    assert "steps" not in case, f"{path.name}: its steps are its snapshot's lines"
    assert len(path.read_bytes()) < LARGEST_CASE, f"{path.name}: keep the case's bulk in its facts or snapshot"
    if path.stem.startswith("noop"):  # a host already right: nothing to change
        assert not [s for s in got if s.fields.get("status") in ("changed", "failed")
                    or s.head.startswith(("stopped ", "failed "))], "a no-op case plans a change"


def test_the_cases_and_snapshots_stay_small():
    files = [*CASES, *(plans.HERE / "defaults").glob("*.json"), *(plans.HERE / "snapshots").glob("*/*.txt")]
    size = sum(len(p.read_bytes()) for p in files)
    assert size < LARGEST_PLANS, f"the plan cases and snapshots are {size} bytes: over {LARGEST_PLANS}"


def test_every_role_has_a_noop_case_and_a_change_case():
    import roles
    for role in roles.ORDER:
        names = [p.stem for p in CASES if p.parent.name == role]
        assert any(n.startswith("noop") for n in names), f"{role}: no no-op case"
        assert any(not n.startswith("noop") for n in names), f"{role}: no case that changes something"


def test_no_snapshot_is_left_without_its_case():
    shots = sorted((plans.HERE / "snapshots").glob("*/*.txt"))
    assert [s for s in shots if not (plans.HERE / "cases" / s.parent.name / f"{s.stem}.json").exists()] == []


def test_a_text_close_to_one_shown_before_is_a_diff_from_it_word_by_word():
    unit = "".join(f"Line{i}=value {i}\n" for i in range(20))
    moved = unit.replace("value 3\n", "value 33\n").replace("Line9=value 9\n", "")
    body = plans._closest(moved, [("above: file unit", unit)])
    assert body == "@diff from above: file unit\n@@ 4\n~Line3=value [-3-]{+33+}\n@@ 10\n-Line9=value 9\n"
    assert plans._closest(unit, [("fresh-host: file unit", unit)]) == "@same as fresh-host: file unit\n"
    assert plans._closest("other\n" * 20, [("above: file unit", unit)]) is None  # shown whole


ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=(?:'[^']*'|\S*)\n", re.M)
# a file a program writes: write_file.sh's call with the file's content as its heredoc, in a function
# the program calls (roll.sh's write_unit)
WRITE = re.compile(r"^(write_unit\(\) \{\n)?write_file [^\n]*<<'__CONVERGE_EOF__'\n.*?^__CONVERGE_EOF__\n(\}\n)?",
                   re.M | re.S)


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_every_script_a_role_sends_is_program_files_and_their_parameters(path: Path):
    """What each step sends a host: its parameters (NAME=value), program files whole (the host
    programs under roles/, converge/ and day2/), a file to write as write_file's call; or `true`."""
    for step in steps_of(path):
        if step.text is None or not step.head.startswith(("command", "handler")):
            continue
        rest = step.text
        for _, body in plans._program_files(smallest=1):
            rest = rest.replace(body, "")
        rest = ASSIGNMENT.sub("", WRITE.sub("", rest))
        left = [line for line in rest.splitlines() if line.strip() not in ("", "{", "}", "true")]
        assert left == [], f"{step.head}: shell that is no program file: {left[:3]}"


@pytest.mark.parametrize("name", ["frontdoor/noop-rtx01", "gateway/noop-gateway01"])
def test_a_keys_run_on_a_host_as_deploy_left_it_changes_nothing(name: str):
    """`invoke keys.add`'s run (its role's own, smaller set of facts) on a host as a deploy left it,
    with the same keys: nothing written, nothing reloaded. Its configuration's generation counts
    what the deploy's counts, or each keys run would leave a configuration the next deploy
    rewrites and reloads for nothing."""
    from roles.frontdoor.role import KEYS_ROLE as FRONTDOOR_KEYS
    from roles.gateway.role import KEYS_ROLE as GATEWAY_KEYS
    case = plans.load(plans.HERE / "cases" / f"{name}.json")
    keys_role = {"frontdoor": FRONTDOOR_KEYS, "gateway": GATEWAY_KEYS}[case["role"]]
    settled = plans.settle(case)
    done = plans.run(case, settled, run_roles=[keys_role])
    statuses = [(t.task, t.status) for t in done.report.tasks]
    assert statuses and not [s for s in statuses if s[1] not in ("ok",)], statuses
    # a run on a deployed instance (not "the keys take effect at its first deploy"): its files, its reload
    assert [s[0].rsplit(" ", 1)[-1] for s in statuses if s[0].endswith(("configuration", "reloaded"))] == \
        ["configuration", "reloaded"], statuses
    # what it reads is what the deploy's role gathers (the same facts, fewer of them)
    with tempfile.TemporaryDirectory() as secrets_dir:
        v = plans.hostvars(case, secrets_dir)
    deploy_facts = next(r for r in plans._roles(case) if r.name == case["role"]).facts(v)
    keys_facts = keys_role.facts(v)
    assert set(keys_facts) < set(deploy_facts)
    assert {n: f.command for n, f in keys_facts.items()} == {n: deploy_facts[n].command for n in keys_facts}
