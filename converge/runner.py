"""Run roles on many hosts in parallel: one connection, one lock, one fact
gathering per host; a failing host never stops the others."""
from __future__ import annotations

import os
import shlex
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import facts as factlib
from .changes import Check, Command, File, HostContext, Role
from .connection import HOST_PATIENCE_S, Connection
from .relay import RelayView
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


# The lock lasts as long as this run is alive: the connection sends a line every
# HEARTBEAT_S seconds on the held script's stdin. If the control process dies, sshd
# closes the channel and `head` sees EOF; if the link dies (or the control machine
# freezes), no line comes within HOST_PATIENCE_S and the host lets the lock go.
def keep_holding(patience: int) -> str:
    # `exit` on the same line: a shell reading its script from stdin would otherwise wait
    # there for more script, and keep the lock
    return f"while l=$(timeout {int(patience)} head -n 1) && [ -n \"$l\" ]; do :; done; exit\n"


KEEP_HOLDING = keep_holding(HOST_PATIENCE_S)


class RunControl:
    """Stops a run from outside (Ctrl-C, SIGTERM): ``stop`` lets the steps in
    flight finish and starts nothing new; ``abandon`` also closes every
    connection, which ends the steps in flight on our side (a command already on
    a host finishes there: its writes are atomic)."""

    def __init__(self):
        self.stopping = threading.Event()
        self.abandoned = False
        self.reason: str | None = None
        self._lock = threading.Lock()
        self._connections: set = set()

    def stop(self, reason: str):
        with self._lock:
            self.reason = self.reason or reason
        self.stopping.set()

    def abandon(self, reason: str):
        self.stop(reason)
        with self._lock:
            self.abandoned = True
            connections = list(self._connections)
        for conn in connections:
            conn.close()

    def opened(self, conn):
        with self._lock:
            self._connections.add(conn)
            late = self.abandoned
        if late:
            conn.close()

    def closed(self, conn):
        with self._lock:
            self._connections.discard(conn)


class Interrupted(ConvergeError):
    """The run was stopped from outside before this step."""


class HostRun:
    def __init__(self, target: Target, roles: list[Role], report: Report, check: bool, lock_name: str,
                 lock_wait: float, fact_timeout: float, control: RunControl | None = None, relay=None):
        self.target = target
        self.roles = roles
        self.report = report
        self.check = check
        self.lock_name = lock_name
        self.lock_wait = lock_wait
        self.fact_timeout = fact_timeout
        self.control = control or RunControl()
        self.failed = False
        self.held = None
        self.relay = relay
        self._background: list = []  # (step, role, label, started, thread, outcome) still running

    def _result(self, role, task, status, message="", diff="", started=None):
        self.report.add(TaskResult(self.target.name, role, task, status, message, diff,
                                   time.monotonic() - started if started else 0.0))

    def run(self):
        try:
            self._run()
        except Exception as exc:  # noqa: BLE001 - one host's surprise must not end the others' runs
            self._result("run", "host", "failed", f"internal error: {type(exc).__name__}: {str(exc)[:400]} "
                         f"(the other hosts went on; please report this with the output of --json)")

    def _interrupted(self, what: str):
        self._result("run", "interrupted", "interrupted", f"{self.control.reason}: stopped before {what}")

    def _run(self):
        name = self.target.name
        self.report.host(name)
        if self.control.stopping.is_set():
            self._interrupted("connecting")
            return
        started = time.monotonic()
        try:
            conn = self.target.connect()
        except ConnectionFailed as exc:
            self._result("connect", "ssh", "unreachable", str(exc), started=started)
            return
        except ConvergeError as exc:  # a setting that cannot be used (e.g. a become password file)
            self._result("connect", "settings", "failed", str(exc), started=started)
            return
        self.control.opened(conn)
        with conn:
            try:
                self._locked(conn)
            except Interrupted as exc:
                self._interrupted(str(exc))
            except ConnectionFailed as exc:
                if self.control.abandoned:  # we closed it
                    self._interrupted("the end of the steps in flight (abandoned)")
                else:
                    self._result("connect", "ssh", "unreachable", str(exc))
            except BecomeRefused as exc:
                self._result("connect", "become", "failed", str(exc), started=started)
            except ConvergeError as exc:
                self._result("run", "host", "failed", str(exc))
            finally:
                self.control.closed(conn)

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
        self.held = held
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
        address = conn.local_address() if self.relay is not None else None
        if address and self.target.vars.get("artifact_relay", True):
            ctx.relay = RelayView(self.relay, address)
        self._result("facts", f"gathered {len(wanted)} facts", "ok", started=started)
        self.notified = []
        try:
            for role in self.roles:
                if not self._role(conn, role, ctx):
                    return
            if self._join(ctx):
                self._flush(conn, ctx)
        finally:
            self._join(ctx)  # whatever happened, a background step's outcome is reported
            for role in self.roles:
                if role.summary:
                    self.report.extra.setdefault(self.target.name, {}).update(role.summary(ctx))

    def _role(self, conn, role: Role, ctx: HostContext) -> bool:
        if not role.overlaps and not self._join(ctx):
            return False
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

    def _join(self, ctx: HostContext) -> bool:
        """Wait for the background steps and report each as if it had just run."""
        pending, self._background = self._background, []
        ok = True
        for step, role, label, started, thread, outcome in pending:
            thread.join()
            self.report.transfer_done(self.target.name, role)
            error = outcome.get("error")
            if isinstance(error, ConnectionFailed):
                raise error
            if error is not None:
                self._result(role, label, "failed", str(error), started=started)
                ok = False
                continue
            if self._done(step, role, label, ctx, started, outcome["result"]):
                if ctx.changed_steps and ctx.changed_steps[-1] is step:
                    self.notified.extend(n for n in step.notify if n not in self.notified)
            else:
                ok = False
        return ok

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
        if self.control.stopping.is_set():
            raise Interrupted(f"{role} | {label}")
        if self.held is not None and not conn.holding(self.held):
            raise ConvergeError(f"the host lock {LOCK_DIR}/{self.lock_name}.lock was let go before {role} | "
                                f"{label} (the host heard nothing from this run for {HOST_PATIENCE_S} s): nothing "
                                f"more was done; deploy again")
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
                output = (result.stdout + result.stderr).strip()
                remedy = (f"; the disk holding {step.path.rsplit('/', 1)[0]} on {self.target.name} is full: free "
                          f"space there and deploy again" if "No space left on device" in output else "")
                self._result(role, label, "failed", f"writing {step.path} failed: {output[-400:]}{remedy}. "
                             f"The file on the host is unchanged (written to a temporary file, then renamed)",
                             started=started)
                return False
            ctx.changed_steps.append(step)
            self._result(role, label, "changed", f"wrote {step.path}", diff, started)
            return True
        if isinstance(step, Command):
            if self.check and not step.probe:
                if step.changes and not step.maybe:
                    ctx.changed_steps.append(step)
                self._result(role, label, "changed" if step.changes and not step.maybe else "skipped",
                             f"would run: {step.describe or step.script.strip()}"
                             f"{' (changes only if it finds something new)' if step.maybe else ''}", started=started)
                return True
            on_line = (lambda line: self.report.progress(self.target.name, role, line, step.progress)) \
                if step.progress else None
            if step.background and not self.check:
                outcome: dict = {}

                def work():
                    try:
                        outcome["result"] = conn.run(step.script, timeout=step.timeout, on_output=on_line)
                    except Exception as exc:  # noqa: BLE001 - reported when joined
                        outcome["error"] = exc

                thread = threading.Thread(target=work, name=f"{self.target.name}-{label}", daemon=True)
                thread.start()
                self._background.append((step, role, label, started, thread, outcome))
                self.report.progress(self.target.name, role, f"{label}: under way, beside what follows")
                return True
            try:
                result = conn.run(step.script, timeout=step.timeout, on_output=on_line)
            except RemoteCommandError as exc:
                self._result(role, label, "failed", str(exc), started=started)
                return False
            finally:
                self.report.transfer_done(self.target.name, role)
            return self._done(step, role, label, ctx, started, result)
        raise TypeError(f"unknown step {step!r}")

    def _done(self, step: Command, role: str, label: str, ctx: HostContext, started: float, result) -> bool:
        """Report a command that ran: its interpretation, failure or change."""
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


def run(targets: list[Target], roles: list[Role], report: Report, *, check: bool = False, forks: int = 10,
        lock_name: str = "converge", lock_wait: float = 300, fact_timeout: float = 120,
        control: RunControl | None = None, relay=None) -> Report:
    """``relay``: the run's artifact relay (converge.relay), offered to the hosts'
    roles when several hosts run together."""
    control = control or RunControl()
    relay = relay if len(targets) > 1 else None

    def one(target):
        HostRun(target, roles, report, check, lock_name, lock_wait, fact_timeout, control, relay).run()

    with ThreadPoolExecutor(max_workers=max(1, min(forks, len(targets) or 1))) as pool:
        list(pool.map(one, targets))
    return report
