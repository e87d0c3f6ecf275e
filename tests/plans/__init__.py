"""Role plans as data, as pyinfra tests its operations: facts in, steps out.

A case (``cases/<role>/<name>.json``) names a fact file captured from a real host
(``facts/<host>.json``, by ``capture.py``) with the changes it makes to it, the
host's variables, the secrets it needs (written to 0600 files), and what the
read-only probes printed (``outputs``, by step name). The API key of the cases is
``sk-plan-test-key``: a case whose host holds it says so by giving the captured
environment file that key's sha256 (the lab's own key is not in the repository). The roles run in their
order up to the role under test, as the runner would run them in check mode;
the steps of that role are compared with the case's ``steps``.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import roles
from converge.changes import Check, Command, File, HostContext, Produced, mask_secret
from converge.errors import StepFailed
from converge.facts import Facts
from converge.transport import Result
from roles.fleet import fleet_of

HERE = Path(__file__).parent


def _sets(obj):
    if set(obj) != {"__set__"}:
        return obj
    return {tuple(x) if isinstance(x, list) else x for x in obj["__set__"]}


def load(path: Path) -> dict:
    return json.loads(path.read_text(), object_hook=_sets)


def facts_for(case: dict) -> Facts:
    base = load(HERE / "facts" / f"{case['facts']}.json")
    values, errors = dict(base["facts"]), dict(base["fact_errors"])
    for name, value in case.get("facts_changes", {}).items():
        if isinstance(value, dict) and isinstance(values.get(name), dict) and not value.get("__replace__"):
            values[name] = {**values[name], **value}
        else:
            values[name] = value.get("value") if isinstance(value, dict) and value.get("__replace__") else value
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


def describe(step) -> dict:
    """A step as the case files write it."""
    if isinstance(step, Check):
        return {"check": step.name, "ok": step.ok, "message": step.message}
    out = {"file" if isinstance(step, File) else "command": step.name, "needed": step.needed()}
    if step.notify:
        out["notify"] = list(step.notify)
    if isinstance(step, File):
        out.update(path=step.path, mode=step.mode, owner=f"{step.owner}:{step.group}")
        if step.needed():
            out["content"] = (mask_secret(step.content, step.is_env()) if step.secret else step.content).splitlines()
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
            out["script"] = step.script.splitlines()
    return out


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


def plan(case: dict) -> list[dict]:
    """The steps of the case's role, after the roles before it (check mode)."""
    with tempfile.TemporaryDirectory() as secrets_dir:
        v = hostvars(case, secrets_dir)
        v["credentials_dir"] = credentials(secrets_dir)
        v["group_names"] = case.get("group_names", [])
        host = case.get("host", "host")
        ctx = HostContext(host, v, facts_for(case), check=True)
        # the fleet as the run offers it: the case's hosts (by default this one, serving)
        ctx.services["fleet"] = fleet_of(case.get("fleet") or {host: v})
        ctx.handlers_run = set(case.get("handlers_run", []))
        # handlers the steps before it notified (a new image, new weights)
        ctx.notified = list(case.get("notified", []))
        steps = []
        for role in [r for r in _roles(case) if r.hosts is None or r.hosts(v)]:
            try:
                planned = list(role.plan(ctx)) if role.name == "day2" else role.plan(ctx)
            except StepFailed as exc:  # the runner reports the role's plan as failed, nothing run
                return steps + [{"failed": f"{role.name} | plan: {exc}"}]
            for step in planned:
                if role.name == case["role"]:
                    steps.append(describe(step))
                # what the runner does in check mode: a step that would change notifies its handlers
                if step.notify and step.needed() and (isinstance(step, File) or (
                        isinstance(step, Command) and step.changes and not step.maybe and not step.probe)):
                    ctx.notified.extend(n for n in step.notify if n not in ctx.notified)
                if isinstance(step, Check) and not step.ok:  # the runner stops the host here
                    return steps if role.name == case["role"] else [{"stopped": f"{role.name} | {step.name}: "
                                                                                 f"{step.message}"}]
                if isinstance(step, Command) and step.needed() and step.interpret and \
                        (step.probe or not ctx.check) and step.name in case.get("outputs", {}):
                    got = case["outputs"][step.name]
                    said = step.interpret(Result(got.get("rc", 0), got.get("stdout", ""), got.get("stderr", "")))
                    if isinstance(said, Produced):
                        ctx.results.record(step.produces, said.value, step.name)
        return steps
