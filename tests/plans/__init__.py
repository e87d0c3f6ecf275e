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
produce or decide. A probe is answered with the case's recorded output. The case states
the intent of each step of its role (its status, what it notifies, what it produces, a
digest of its script or content); the text behind each digest is in the case's snapshot
(``snapshots/<role>/<name>.txt``), so that a script change reads as one diff there.
"""
from __future__ import annotations

import fnmatch
import functools
import hashlib
import json
import os
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
from roles.fleet import fleet_of
from roles.handoffs import FRONTDOOR_GENERATION, GATEWAY_GENERATION

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
    return json.loads(path.read_text(), object_hook=_sets)


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


def run(case: dict, facts: Facts | None = None, credentials_dir: str | None = None) -> Run:
    """The case's roles on its facts, through the runner's own executor, in check mode
    (``credentials_dir``: the control machine's credentials there, else the tests' own)."""
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

        executor = HostRun(Target(host, v, None), _roles(case), done.report, check=True, commands=_answers(case),
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
PROGRAM_FILES = ("roles/*/files/*", "roles/*.sh", "roles/exporters/*.sh", "converge/host_scripts/*")
SMALLEST_NAMED = 200  # a shorter file is shown as it is: its name would be no shorter


@functools.lru_cache(maxsize=1)
def _program_files() -> tuple:
    root = HERE.parent.parent
    found = {path for pattern in PROGRAM_FILES for path in root.glob(pattern) if path.is_file()}
    texts = [(str(path.relative_to(root)), path.read_text()) for path in sorted(found)]
    return tuple(sorted((t for t in texts if len(t[1]) >= SMALLEST_NAMED), key=lambda t: -len(t[1])))


def as_shown(text: str) -> str:
    """A script or file as its snapshot shows it: each program file it holds whole named by its
    path and digest."""
    for path, body in _program_files():
        if body in text:
            lines = body.count("\n")
            text = text.replace(body, f"@file {path} {_digest(body)} ({lines} lines)\n")
    return text


def describe(taken: Taken) -> tuple[dict, list[tuple[str, str]]]:
    """A step as the case writes it, and the texts (title, text) its snapshot keeps."""
    step, result = taken.step, taken.result
    status = result.status if result is not None else "ok"
    if isinstance(step, Decision):
        return {"decision": step.name, "produces": step.produces.name}, []
    if isinstance(step, Check):
        return {"check": step.name, "status": status, "message": step.message}, []
    kind = "handler" if taken.handler else "file" if isinstance(step, File) else "command"
    out = {kind: step.name, "status": status}
    if step.notify:
        out["notify"] = list(step.notify)
    texts = []
    if isinstance(step, File):
        out.update(path=step.path, mode=step.mode, owner=f"{step.owner}:{step.group}")
        if step.needed():
            text = mask_secret(step.content, step.is_env()) if step.secret else step.content
            out["content"] = _digest(text)
            texts.append((f"{taken.role} | {step.name}: {step.path}", text))
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
            out["script"] = _digest(step.script)
            texts.append((f"{taken.role} | {'handler: ' if taken.handler else ''}{step.name}", step.script))
    if result is not None and status in ("failed", "skipped") and result.message:
        out["message"] = result.message
    return out, texts


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


def plan(case: dict) -> tuple[list[dict], str]:
    """The steps of the case's role as the executor took them (check mode), and its snapshot."""
    done = run(case, settle(case) if case.get("settled") else None)
    steps, texts = [], []
    for taken in done.taken:
        if taken.role != case["role"]:
            continue
        described, shown = describe(taken)
        steps.append(described)
        texts += shown
    # what stopped the host before its role, or the role's own plan
    for task in done.report.tasks:
        if task.status == "failed" and (task.role != case["role"] or task.task == "plan"):
            steps.append({"stopped" if task.role != case["role"] else "failed": f"{task.role} | {task.task}: "
                                                                                  f"{task.message}"})
    snapshot = "".join(f"==== {title} ({_digest(text)})\n{as_shown(text)}{'' if text.endswith(chr(10)) else chr(10)}"
                       for title, text in texts)
    return steps, snapshot
