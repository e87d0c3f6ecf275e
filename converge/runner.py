"""Run roles on many hosts in parallel: one connection, one lock, one fact
gathering per host; a failing host never stops the others."""
from __future__ import annotations

import os
import shlex
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import facts as factlib
from .changes import Check, Command, File, HostContext, Role
from .connection import Connection
from .errors import BecomeRefused, ConnectionFailed, ConvergeError, RemoteCommandError, StepFailed
from .report import Report, TaskResult

LOCK_DIR = "/run/lock"
FIRST_ANSWER_S = 15  # for the held script to start and say whether it has the lock


@dataclass
class Target:
    """A host to converge: its resolved variables and how to reach it."""

    name: str
    vars: dict
    connect: callable  # () -> Connection (opened)


def lock_script(name: str, wait: float, holder: str) -> str:
    """Take an flock on the host and print ``locked`` (``busy HOLDER`` first
    if another run has it). Whatever follows runs under the lock; the script
    must end with `KEEP_HOLDING`.
    """
    path = shlex.quote(f"{LOCK_DIR}/{name}.lock")
    return (
        f"exec 2>&1; [ -d {LOCK_DIR} ] || mkdir -p {LOCK_DIR}; exec 9>>{path}\n"
        f"if ! flock -n 9; then printf 'busy %s\\n' \"$(cat {path}.holder 2>/dev/null)\"; "
        f"flock -w {int(wait)} 9 || {{ echo timeout; exit 75; }}; fi\n"
        f"printf '%s\\n' {shlex.quote(holder)} > {path}.holder\n"
        "echo locked\n"
    )


# The lock lasts as long as our stdin stays open: if the control process dies,
# sshd closes the channel, `cat` sees EOF and the lock goes with it.
KEEP_HOLDING = "exec cat >/dev/null\n"


class HostRun:
    def __init__(self, target: Target, roles: list[Role], report: Report, check: bool, lock_name: str,
                 lock_wait: float, fact_timeout: float):
        self.target = target
        self.roles = roles
        self.report = report
        self.check = check
        self.lock_name = lock_name
        self.lock_wait = lock_wait
        self.fact_timeout = fact_timeout
        self.failed = False

    def _result(self, role, task, status, message="", diff="", started=None):
        self.report.add(TaskResult(self.target.name, role, task, status, message, diff,
                                   time.monotonic() - started if started else 0.0))

    def run(self):
        name = self.target.name
        self.report.host(name)
        started = time.monotonic()
        try:
            conn = self.target.connect()
        except ConnectionFailed as exc:
            self._result("connect", "ssh", "unreachable", str(exc), started=started)
            return
        except ConvergeError as exc:  # a setting that cannot be used (e.g. a become password file)
            self._result("connect", "settings", "failed", str(exc), started=started)
            return
        with conn:
            try:
                self._locked(conn)
            except ConnectionFailed as exc:
                self._result("connect", "ssh", "unreachable", str(exc))
            except BecomeRefused as exc:
                self._result("connect", "become", "failed", str(exc), started=started)
            except ConvergeError as exc:
                self._result("run", "host", "failed", str(exc))

    def _locked(self, conn: Connection):
        """Lock the host and gather its facts in one script (one round trip),
        which then keeps the lock until the run on this host is over."""
        holder = f"{socket.gethostname()} pid {os.getpid()} since {time.strftime('%Y-%m-%d %H:%M:%S')}"
        started = time.monotonic()
        wanted: dict = {}
        for role in self.roles:
            wanted.update(role.facts(self.target.vars))
        gathering = factlib.Gathering(wanted)
        # inline: facts hold no secret (a secret file is only hashed), so the script may
        # be the exec request's command line, one round trip less than stdin
        held = conn.hold(lock_script(self.lock_name, self.lock_wait, holder) + gathering.script + KEEP_HOLDING,
                         timeout=FIRST_ANSWER_S, inline=True)
        try:
            first = held.readline(FIRST_ANSWER_S)
            if first is not None and first.startswith("busy"):
                self.report.note(f"[yellow]waiting[/yellow]     {self.target.name} for the lock held by "
                                 f"{first[5:] or 'another run'} (up to {self.lock_wait:g} s)")
                first = held.readline(self.lock_wait + 10)
            if first == "timeout":
                raise ConvergeError(f"another run is converging this host and kept its lock for more than "
                                    f"{self.lock_wait:g} s ({LOCK_DIR}/{self.lock_name}.lock); try again when it "
                                    f"is done, or pass a longer --lock-wait")
            if first is None:
                conn.refused(held)  # sudo said no (wrong password, not allowed): say that, not "no word"
            if first != "locked":
                raise ConvergeError(f"could not take the host lock {LOCK_DIR}/{self.lock_name}.lock: "
                                    f"{first or 'the shell ended without a word'}")
            output, complete = held.read_until(gathering.done, self.fact_timeout)
        except RemoteCommandError as exc:
            raise ConvergeError(f"gathering facts: {exc}") from exc
        if not complete:
            raise ConvergeError(f"gathering facts: the fact script ended early: {output.strip()[-300:]}")
        ctx = HostContext(self.target.name, self.target.vars, None, check=self.check)
        ctx.facts = gathering.parse(output)
        self._result("facts", f"gathered {len(wanted)} facts", "ok", started=started)
        self.notified = []
        try:
            for role in self.roles:
                if not self._role(conn, role, ctx):
                    return
            self._flush(conn, ctx)
        finally:
            for role in self.roles:
                if role.summary:
                    self.report.extra.setdefault(self.target.name, {}).update(role.summary(ctx))

    def _role(self, conn, role: Role, ctx: HostContext) -> bool:
        if role.flush_handlers and not self._flush(conn, ctx):
            return False
        try:
            for step in role.plan(ctx):
                if not self._step(conn, role.name, step, ctx):
                    return False
                if ctx.changed_steps and ctx.changed_steps[-1] is step:
                    self.notified.extend(n for n in step.notify if n not in self.notified)
        except (StepFailed, factlib.FactError) as exc:
            self._result(role.name, "plan", "failed", str(exc))
            return False
        return True

    def _flush(self, conn, ctx: HostContext) -> bool:
        """Run notified handlers once each, in the order their roles declare them."""
        pending, self.notified = self.notified, []
        if not pending:
            return True
        for role in self.roles:
            if not role.handlers:
                continue
            for hname, handler in role.handlers(ctx).items():
                if hname in pending and hname not in ctx.handlers_run:
                    if not self._step(conn, role.name, handler, ctx, handler=True):
                        return False
                    ctx.handlers_run.add(hname)
        return True

    def _step(self, conn, role: str, step, ctx: HostContext, handler=False) -> bool:
        label = f"handler: {step.name}" if handler else step.name
        started = time.monotonic()
        if isinstance(step, Check):
            self._result(role, label, "ok" if step.ok else "failed", step.message, started=started)
            return step.ok
        if not step.needed():
            msg = "" if isinstance(step, File) else getattr(step, "describe", "")
            self._result(role, label, "ok", "" if isinstance(step, Command) else msg, started=started)
            return True
        if isinstance(step, File):
            diff = step.diff()
            if self.check:
                self._result(role, label, "changed", f"would write {step.path}", diff, started)
                ctx.changed_steps.append(step)
                return True
            result = conn.run(step.script(), timeout=60)
            if not result.ok:
                self._result(role, label, "failed", f"writing {step.path} failed: "
                             f"{(result.stdout + result.stderr).strip()[-400:]}", started=started)
                return False
            ctx.changed_steps.append(step)
            self._result(role, label, "changed", f"wrote {step.path}", diff, started)
            return True
        if isinstance(step, Command):
            if self.check:
                if step.changes and not step.maybe:
                    ctx.changed_steps.append(step)
                self._result(role, label, "changed" if step.changes and not step.maybe else "skipped",
                             f"would run: {step.describe or step.script.strip()}"
                             f"{' (changes only if it finds something new)' if step.maybe else ''}", started=started)
                return True
            on_line = (lambda line: self.report.progress(self.target.name, role, line)) if step.progress else None
            try:
                result = conn.run(step.script, timeout=step.timeout, on_output=on_line)
            except RemoteCommandError as exc:
                self._result(role, label, "failed", str(exc), started=started)
                return False
            try:
                message = step.interpret(result) if step.interpret else None
            except StepFailed as exc:
                self._result(role, label, "failed", str(exc), started=started)
                return False
            if step.interpret is None and not result.ok:
                tail = (result.stdout + result.stderr).strip()[-600:]
                self._result(role, label, "failed", f"exit {result.rc}: {tail}", started=started)
                return False
            changed = step.changes
            if isinstance(message, tuple):  # interpret may say whether the host really changed
                message, changed = message
            if changed:
                ctx.changed_steps.append(step)
            self._result(role, label, "changed" if changed else "ok", message or step.describe, started=started)
            return True
        raise TypeError(f"unknown step {step!r}")


def run(targets: list[Target], roles: list[Role], report: Report, *, check: bool = False, forks: int = 10,
        lock_name: str = "converge", lock_wait: float = 300, fact_timeout: float = 120) -> Report:
    def one(target):
        HostRun(target, roles, report, check, lock_name, lock_wait, fact_timeout).run()

    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(targets) or 1))) as pool:
        list(pool.map(one, targets))
    return report
