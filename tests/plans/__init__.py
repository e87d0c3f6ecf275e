"""Role plans as data, as pyinfra tests its operations: facts in, steps out.

A case (``cases/<role>/<name>.json``) names a fact file captured from a real host
(``facts/<host>.json``, by ``capture.py``) with the changes it makes to it, the host's
variables, the secrets it needs (written to 0600 files), and what the read-only probes
printed (``outputs``, by step name). The API key of the cases is ``sk-plan-test-key``: a
case whose host holds it says so by giving the captured environment file that key's
sha256 (the lab's own key is not in the repository). A case marked ``settled`` is a host
as the roles leave it: its files as the roles write them (and its instance answering with
their generation), from whatever was captured.

The roles run in their order up to the role under test, through the runner's own step
executor (converge.runner.HostRun.converge) in check mode, as ``deploy --check`` runs
them: a step needed or not, a change and the handlers it notifies, the steps that
changed before it (a new environment file restarting the front door), the values steps
produce or decide. A probe is answered with the case's recorded output. What the role does
is the case's snapshot (``snapshots/<role>/<name>.txt``): a line a step (its status, what it
notifies, produces or says it would do), and below it the text behind it, a file's content
or a command's script. A program file a script holds whole is named by its path and digest,
not shown (its own tests read it); a file it writes is shown as its text, not its base64; a
text the same as, or close to, one shown before it (above, or in an earlier case of the
role) is shown as that, or as a diff from it, changes marked word by word. A case holds
only what is its own: what most of its role's cases share is in ``defaults/<role>.json``.
"""
from __future__ import annotations

import base64
import difflib
import fnmatch
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import roles
from converge.changes import Check, Command, Decision, File, HostContext, mask_secret
from converge.errors import RemoteCommandError
from converge.facts import Facts
from converge.facts.host import FileState, UnitFiles
from converge.report import Report
from converge.runner import HostRun, Target
from converge.transport import Result
from serving.fleet import fleet_of
from serving.handoffs import FRONTDOOR_GENERATION, GATEWAY_GENERATION

HERE = Path(__file__).parent
# how deep a case's change to a fact merges into it: 1, its keys (a FileState's mode, a UnitState's
# ActiveState); replica_units' down to a unit's own (path -> {"file", "state"} -> their keys)
PATH_FACTS = {"replica_units": 3}
# what an HAProxy instance answers as, once it has loaded what its role decided
SERVED = {FRONTDOOR_GENERATION: "frontdoor_served", GATEWAY_GENERATION: "gateway_served"}


def _sets(obj):
    if set(obj) != {"__set__"}:
        return obj
    return {tuple(x) if isinstance(x, list) else x for x in obj["__set__"]}


def load(path: Path) -> dict:
    """A case, over its role's defaults (``defaults/<role>.json``: what most of its cases share, as
    an Ansible role's defaults are; a key the case sets replaces the default's whole)."""
    defaults = HERE / "defaults" / f"{path.parent.name}.json"
    base = json.loads(defaults.read_text(), object_hook=_sets) if defaults.exists() else {}
    return {**base, **json.loads(path.read_text(), object_hook=_sets)}


def _merged(base, change, depth: int):
    """``change`` over ``base``: ``{"__replace__": true, "value": V}`` is V, None (a path's)
    is gone, a dict merges into a dict ``depth`` levels down, anything else replaces."""
    if isinstance(change, dict) and change.get("__replace__"):
        return change.get("value")
    if depth <= 0 or not isinstance(change, dict) or not isinstance(base, dict):
        return change
    out = dict(base)
    for key, value in change.items():
        if value is None and depth > 0:
            out.pop(key, None)
        else:
            out[key] = _merged(base.get(key), value, depth - 1)
    return out


def facts_for(case: dict) -> Facts:
    base = load(HERE / "facts" / f"{case['facts']}.json")
    values, errors = dict(base["facts"]), dict(base["fact_errors"])
    for name, value in case.get("facts_changes", {}).items():
        values[name] = _merged(values.get(name), value, PATH_FACTS.get(name, 1))
    for name, message in case.get("fact_errors", {}).items():
        values.pop(name, None)
        errors[name] = message
    return Facts(values, errors)


def hostvars(case: dict, secrets_dir: str) -> dict:
    """The case's variables over the roles' defaults; each of its ``secrets`` written to a 0600
    file, named by the variable of that name, or (a secret ``@NAME``) where a value says
    ``@secret:NAME`` (a secret's file nested in a structure: a receiver's token)."""
    merged = {}
    for source in roles.defaults():
        merged.update(source.values)
    merged.update(case.get("vars", {}))
    paths = {}
    for var, text in case.get("secrets", {}).items():
        name = var.removeprefix("@")  # "@NAME": a file that no variable of that name holds
        path = os.path.join(secrets_dir, name)
        with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
            handle.write(text)
        paths[name] = path
        if not var.startswith("@"):
            merged[var] = path

    def placed(value):
        if isinstance(value, str) and value.startswith("@secret:"):
            return paths[value.removeprefix("@secret:")]
        if isinstance(value, dict):
            return {k: placed(v) for k, v in value.items()}
        if isinstance(value, list):
            return [placed(v) for v in value]
        return value

    return {k: placed(v) for k, v in merged.items()}


def credentials(secrets_dir: str) -> str:
    """A copy of the fixed test credentials (a CA and certificates valid for a century,
    made by make_credentials.py), with the modes the code insists on."""
    target = Path(secrets_dir) / "credentials"
    shutil.copytree(HERE / "credentials", target)
    for path in target.rglob("*"):
        path.chmod(0o700 if path.is_dir() else 0o600)
    target.chmod(0o700)
    return str(target)


def _roles(case: dict) -> list:
    """The roles the case runs: a day-2 command's alone (``"role": "day2"``, ``"command":
    {"name": "restart", "args": {...}}``), else every role up to the case's, in order."""
    if case["role"] == "day2":
        from day2 import lifecycle
        command = case["command"]
        role = getattr(lifecycle, f"{command['name']}_role")(**command.get("args", {}))
        role.name = "day2"
        return [role]
    return roles.load(roles.ORDER[:roles.ORDER.index(case["role"]) + 1])


@dataclass
class Taken:
    """One step as the executor took it, and what it reported of it."""
    role: str
    step: object
    handler: bool
    result: object = None  # converge.report.TaskResult (None: a Decision that reports nothing)


@dataclass
class Run:
    ctx: HostContext
    taken: list = field(default_factory=list)
    report: Report = None


def _answers(case: dict):
    """The runner's command hook: a probe (the only command check mode runs) answered with the
    case's recorded output for it."""
    outputs = case.get("outputs", {})

    def answer(conn, step, on_output):
        if step.name not in outputs:
            raise RemoteCommandError(f"the case records no output for the probe {step.name!r}")
        got = outputs[step.name]
        return Result(got.get("rc", 0), got.get("stdout", ""), got.get("stderr", ""))
    return answer


def run(case: dict, facts: Facts | None = None, credentials_dir: str | None = None, run_roles: list | None = None) -> Run:
    """The case's roles (or ``run_roles``: another command's, keys.add's) on its facts, through the
    runner's own executor, in check mode (``credentials_dir``: the control machine's credentials
    there, else the tests' own)."""
    with tempfile.TemporaryDirectory() as secrets_dir:
        v = hostvars(case, secrets_dir)
        v["credentials_dir"] = credentials_dir or credentials(secrets_dir)
        v["group_names"] = case.get("group_names", [])
        host = case.get("host", "host")
        ctx = HostContext(host, v, facts if facts is not None else facts_for(case), check=True)
        # the fleet as the run offers it: the case's hosts (by default this one, serving)
        ctx.services["fleet"] = fleet_of(case.get("fleet") or {host: v})
        ctx.handlers_run = set(case.get("handlers_run", []))
        # handlers the steps before it notified (a new image, new weights)
        ctx.notified = list(case.get("notified", []))
        done = Run(ctx, report=Report(quiet=True))

        def observe(role, step, handler):
            done.taken.append(Taken(role, step, handler, len(done.report.tasks)))

        executor = HostRun(Target(host, v, None), run_roles or _roles(case), done.report, check=True, commands=_answers(case),
                           observe=observe)
        executor.converge(None, ctx)
    for taken in done.taken:  # each step's line of the report, the one it added as it was taken
        index = taken.result
        silent = isinstance(taken.step, Decision) and not taken.step.message
        taken.result = None if silent or index >= len(done.report.tasks) else done.report.tasks[index]
    return done


def _digest(text: str) -> str:
    return "sha256:" + hashlib.sha256(text.encode()).hexdigest()[:16]


# the files of the programs a host runs (and of the files the roles copy there as they are): a
# snapshot names each by its path and digest where a script or file holds it whole, so that it holds
# a program's parameters, not its body (the file's own tests read the body: tests/test_host_programs.py)
PROGRAM_FILES = ("roles/*/files/*", "serving/files/*", "serving/*/files/*", "converge/host_scripts/*",
                 "converge/facts/files/*", "day2/host_programs/*")
SMALLEST_NAMED = 200  # a shorter file is shown as it is: its name would be no shorter


@functools.lru_cache(maxsize=2)
def _program_files(smallest: int = SMALLEST_NAMED) -> tuple:
    """(path, text) of each program file of at least ``smallest`` characters, the longest first."""
    root = HERE.parent.parent
    found = {path for pattern in PROGRAM_FILES for path in root.glob(pattern) if path.is_file()}
    texts = [(str(path.relative_to(root)), path.read_text()) for path in sorted(found)]
    return tuple(sorted((t for t in texts if len(t[1]) >= smallest), key=lambda t: -len(t[1])))


# a file a script writes (converge.changes' atomic write): shown as its text, not its base64
BASE64_HEREDOC = re.compile(r"(<<'__CONVERGE_EOF__'\n)([A-Za-z0-9+/=\n]*?)(__CONVERGE_EOF__\n)")


def _decoded(match: re.Match) -> str:
    try:
        text = base64.b64decode(match.group(2), validate=False).decode()
    except (ValueError, UnicodeDecodeError):
        return match.group(0)
    return f"{match.group(1)}@base64 of:\n{text}{'' if text.endswith(chr(10)) else chr(10)}{match.group(3)}"


# a line longer than this is shown broken before each of its options (a command line in a unit), so
# that a diff shows the option that changed
LONGEST_LINE = 160
OPTION = re.compile(r" (?=--[A-Za-z])")


def _broken(line: str) -> str:
    return OPTION.sub(" \\\n    ", line) if len(line) > LONGEST_LINE else line


def as_shown(text: str) -> str:
    """A script or file as its snapshot shows it: a file it writes as its text, a long command line
    broken before its options, and each program file it holds whole named by its path and digest."""
    text = BASE64_HEREDOC.sub(_decoded, text)
    for path, body in _program_files():
        if body in text:
            lines = body.count("\n")
            text = text.replace(body, f"@file {path} {_digest(body)} ({lines} lines)\n")
    return "".join(_broken(line) for line in text.splitlines(keepends=True))


@dataclass
class Shown:
    """A step as its case's snapshot shows it: what it is (``head``), the rest of its line (its
    status and what else it declares, ``fields``), and the text behind it (a file's content, a
    command's script) when the step is needed."""
    head: str
    fields: dict
    text: str | None = None

    @property
    def line(self) -> str:
        return "== " + self.head + "".join(f" | {k}: {v if isinstance(v, str) else json.dumps(v)}"
                                           for k, v in self.fields.items())


def describe(taken: Taken) -> Shown:
    step, result = taken.step, taken.result
    status = result.status if result is not None else "ok"
    if isinstance(step, Decision):
        return Shown(f"decision {step.name}", {"produces": step.produces.name})
    if isinstance(step, Check):
        return Shown(f"check {step.name}", {"status": status, "message": step.message})
    kind = "handler" if taken.handler else "file" if isinstance(step, File) else "command"
    shown = Shown(f"{kind} {step.name}", {"status": status})
    out = shown.fields
    if step.notify:
        out["notify"] = list(step.notify)
    if isinstance(step, File):
        out.update(path=step.path, mode=step.mode, owner=f"{step.owner}:{step.group}")
        if step.needed():
            shown.text = mask_secret(step.content, step.is_env()) if step.secret else step.content
    elif isinstance(step, Command):
        out.update({k: True for k in ("background", "probe", "maybe") if getattr(step, k)})
        if not step.changes:
            out["read_only"] = True
        if step.produces:
            out["produces"] = step.produces.name
        if step.throttle:
            out["throttle"] = {"name": step.throttle.name, "limit": step.throttle.limit}
        if step.satisfies:
            out["satisfies"] = list(step.satisfies)
        if step.needed():
            out["describe"] = step.describe  # what check mode says it would do, and why
            shown.text = step.script
    if result is not None and status in ("failed", "skipped") and result.message:
        out["message"] = result.message
    return shown


def _file_facts(case: dict, v: dict) -> tuple[dict, dict]:
    """Every FileState fact of the case's roles by path, and every UnitFiles fact by name."""
    files, globs = {}, {}
    for role in _roles(case):
        for name, fact in role.facts(v).items():
            if isinstance(fact, FileState):
                files[fact.path] = name
            elif isinstance(fact, UnitFiles):
                globs[name] = fact.pattern.split()
    return files, globs


def _before(case: dict) -> dict:
    """The case as its roles last ran on the host (its ``settled``: vars and fleet as they were)."""
    spec = case["settled"] if isinstance(case["settled"], dict) else {}
    before = dict(case)
    if "vars" in spec:
        before["vars"] = {k: v for k, v in {**case.get("vars", {}), **spec["vars"]}.items() if v is not None}
    if "fleet" in spec:
        before["fleet"] = spec["fleet"]
    if "facts_changes" in spec:
        before["facts_changes"] = {**case.get("facts_changes", {}), **spec["facts_changes"]}
    return before


def settle(case: dict) -> Facts:
    """The case's host as its roles left it (`_before`): each file a step would write there, as
    written; each HAProxy instance answering with the generation its role decided. Then the
    case's own changes of its facts over it."""
    before = _before(case)
    writers = (case["settled"] if isinstance(case["settled"], dict) else {}).get("roles")
    facts = facts_for(before)
    for _ in range(4):
        done = run(before, facts)
        with tempfile.TemporaryDirectory() as secrets_dir:
            files, globs = _file_facts(before, hostvars(before, secrets_dir))
        moved = False
        for taken in done.taken:
            step = taken.step
            if not isinstance(step, File) or not step.needed() or (writers and taken.role not in writers):
                continue
            state = {"mode": step.mode.rjust(4, "0"), "owner": step.owner, "group": step.group,
                     "size": len(step.content.encode()), "sha256": step.sha256,
                     **({} if step.secret else {"content": step.content})}
            if step.path in files:
                facts.values[files[step.path]] = state
                moved = True
            for name, patterns in globs.items():
                if any(fnmatch.fnmatch(step.path, p) for p in patterns):
                    entry = dict((facts.values.get(name) or {}).get(step.path) or {})
                    facts.values[name] = {**(facts.values.get(name) or {}), step.path: {**entry, "file": state}}
                    moved = True
        for output, fact in SERVED.items():
            generation = done.ctx.results.get(output)
            if writers and not any(fact.startswith(w) for w in writers):
                continue
            if generation is not None and facts.values.get(fact) != generation:
                facts.values[fact] = generation
                moved = True
        if not moved:
            for name, value in case.get("facts_changes", {}).items():
                if name not in (before.get("facts_changes") or {}) or before["facts_changes"][name] != value:
                    facts.values[name] = _merged(facts.values.get(name), value, PATH_FACTS.get(name, 1))
            return facts
    raise AssertionError(f"{case['role']}: the host does not settle: each plan wants other files than the last")


def plan(case: dict, earlier: tuple = ()) -> tuple[list[Shown], str]:
    """The steps of the case's role as the executor took them (check mode), and its snapshot: a line
    a step, with the text behind it shown whole, or as the same as, or a diff from, a text shown
    before it (above in this snapshot, or in ``earlier``: (case name, steps) of the role's cases
    before this one)."""
    steps = taken(case)
    return steps, snapshot_of(steps, earlier)


def taken(case: dict) -> list[Shown]:
    """The steps of the case's role, each as its snapshot shows it."""
    done = run(case, settle(case) if case.get("settled") else None)
    steps = [describe(step) for step in done.taken if step.role == case["role"]]
    # what stopped the host before its role, or the role's own plan
    for task in done.report.tasks:
        if task.status == "failed" and (task.role != case["role"] or task.task == "plan"):
            kind = "stopped" if task.role != case["role"] else "failed"
            steps.append(Shown(f"{kind} {task.role} | {task.task}", {"message": task.message}))
    return steps


# a text is shown as a diff from one shown before when that diff is this much of it or less
DIFF_AT_MOST = 0.6


WORD = re.compile(r"\w+|\s+|.")


def _changed_line(before: str, after: str) -> str:
    """A line changed in place, its changes marked word by word as ``git diff --word-diff`` does."""
    a, b = WORD.findall(before), WORD.findall(after)
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            out.append("".join(a[i1:i2]))
            continue
        if i2 > i1:
            out.append("[-" + "".join(a[i1:i2]) + "-]")
        if j2 > j1:
            out.append("{+" + "".join(b[j1:j2]) + "+}")
    return "~" + "".join(out) + "\n"


def _diff(before: str, after: str) -> str:
    """What changed from ``before`` to ``after``: each hunk headed by its line in ``after``
    (``@@ N``); a line changed in place once, marked word by word (``~``), else the lines taken out
    (``-``) and put in (``+``)."""
    a, b = before.splitlines(), after.splitlines()
    out = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        out.append(f"@@ {j1 + 1}\n")
        if op == "replace" and i2 - i1 == j2 - j1:
            out += [_changed_line(x, y) for x, y in zip(a[i1:i2], b[j1:j2])]
            continue
        out += [f"-{line}\n" for line in a[i1:i2]] + [f"+{line}\n" for line in b[j1:j2]]
    return "".join(out)


def _closest(shown: str, before: list[tuple[str, str]]) -> str | None:
    """``shown`` as the same as, or a diff from, the text of ``before`` (where, text) it is closest to."""
    best = None
    for where, other in before:
        if other == shown:
            return f"@same as {where}\n"
        matcher = difflib.SequenceMatcher(None, other.splitlines(), shown.splitlines(), autojunk=False)
        if matcher.quick_ratio() < 1 - DIFF_AT_MOST:
            continue
        text = f"@diff from {where}\n{_diff(other, shown)}"
        if len(text) <= DIFF_AT_MOST * len(shown) and (best is None or len(text) < len(best)):
            best = text
    return best


def snapshot_of(steps: list[Shown], earlier: tuple = ()) -> str:
    before = [(f"{name}: {step.head}", as_shown(step.text)) for name, shown in earlier for step in shown
              if step.text is not None]
    out = []
    for step in steps:
        out.append(step.line + "\n")
        if step.text is None:
            continue
        shown = as_shown(step.text)
        out.append(_closest(shown, before) or (shown if shown.endswith("\n") else shown + "\n"))
        before.append((f"above: {step.head}", shown))
    return "".join(out)
