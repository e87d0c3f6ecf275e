"""Run roles on many hosts in parallel: one connection, one lock, one fact
gathering per host; a failing host never stops the others."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from . import facts as factlib
from .batches import batches, too_many_failed
from .changes import Check, Command, Decision, File, HostContext, Produced, Role
from .errors import BecomeRefused, ConnectionFailed, ConvergeError, RemoteCommandError, StepFailed
from .hostlock import HOST_PATIENCE_S, HostLock
from .report import Report, TaskResult
from .transport import Transport


@dataclass
class Target:
    """A host to converge: its resolved variables and how to reach it."""

    name: str
    vars: dict
    connect: callable  # () -> Transport (opened; the run's Connections close it)


class RunService:
    """Something a run offers its hosts' roles while it lasts (an artifact relay,
    say); the engine knows none by name. ``start(hosts)`` as the run begins;
    ``for_host(transport, hostvars)`` is what one host's roles see as
    ``ctx.services[name]`` (None: nothing for this host); ``close()`` at the end
    returns what it did, for the report (None: nothing to report)."""

    name = "service"

    def start(self, hosts: list[str]):
        pass

    def for_host(self, transport: Transport, hostvars: dict):
        return None

    def close(self) -> dict:
        return {}


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


class Throttles:
    """The run's throttled kinds of step (`Command.throttle`): a slot each may hold, and
    why a kind stopped (its first failure), shared by every host of the run."""

    def __init__(self):
        self._lock = threading.Lock()
        self._slots: dict[str, threading.Semaphore] = {}
        self.halted: dict[str, str] = {}

    def _slot(self, name: str, limit: int) -> threading.Semaphore | None:
        if limit <= 0:
            return None
        with self._lock:  # the first step of a kind sets its limit for the run
            return self._slots.setdefault(name, threading.Semaphore(limit))

    def acquire(self, name: str, limit: int, stopping: threading.Event) -> threading.Semaphore | None:
        """Wait for a slot (None: no limit); raise Interrupted when the run stops meanwhile."""
        slot = self._slot(name, limit)
        while slot is not None and not slot.acquire(timeout=0.2):
            if stopping.is_set():
                raise Interrupted("waiting for its turn")
        if slot is not None and stopping.is_set():
            # the turn came as the run stopped (a slot freed within the wait's last 0.2 s): not taken
            slot.release()
            raise Interrupted("waiting for its turn")
        return slot

    def halt(self, name: str, why: str):
        with self._lock:
            self.halted.setdefault(name, why)


class Interrupted(ConvergeError):
    """The run was stopped from outside before this step."""


class HostRun:
    """One host's run: its connection, lock and facts, then `converge`: every role's steps
    in order, each decided and reported here (needed or not, check mode, a change and the
    handlers it notifies, the values steps produce), the handlers flushed, the summaries.

    ``commands`` runs a command step (default: on the host's transport); the plan tests give
    one that answers from recorded output, so that they exercise this very executor."""

    def __init__(self, target: Target, roles: list[Role], report: Report, check: bool, lock_name: str = "converge",
                 lock_wait: float = 300, fact_timeout: float = 120, control: RunControl | None = None, services=(),
                 throttles: Throttles | None = None, commands=None, observe=None):
        self.target = target
        self.roles = [role for role in roles if role.hosts is None or role.hosts(target.vars)]
        self.report = report
        self.check = check
        self.lock_name = lock_name
        self.lock_wait = lock_wait
        self.fact_timeout = fact_timeout
        self.control = control or RunControl()
        self.failed = False
        self.lock: HostLock | None = None
        self.services = services
        self.throttles = throttles or Throttles()
        self._background: list = []  # (step, role, label, started, thread, outcome) still running
        # (conn, step, on_output) -> Result: how a command step runs
        self.commands = commands or (lambda conn, step, on_output:
                                     conn.run(step.script, timeout=step.timeout, on_output=on_output))
        # (role, step, handler) -> None: told of each step as it is taken (the plan tests read them)
        self.observe = observe

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
        try:
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
            if self.lock is not None:
                self.lock.release()
            self.control.closed(conn)

    def _locked(self, conn: Transport):
        """Lock the host and gather its facts in one script (one round trip),
        which then keeps the lock until the run on this host is over."""
        started = time.monotonic()
        wanted: dict = {}
        for role in self.roles:
            wanted.update(role.facts(self.target.vars))
        gathering = factlib.Gathering(wanted)
        # a run that changes nothing (check mode) takes no lock and writes nothing on the host: it
        # reads at once, and says when a run that may change the host holds the lock meanwhile
        self.lock = HostLock(conn, self.lock_name, self.lock_wait, read_only=self.check)

        def busy(holder):
            if self.check:
                self.report.note(f"[yellow]changing[/yellow]    {self.target.name}: another run holds its lock "
                                 f"({holder}); what is read here is the host as it is now, mid-run")
                self.report.extra.setdefault(self.target.name, {})["lock_held_by"] = holder
            else:
                self.report.note(f"[yellow]waiting[/yellow]     {self.target.name} for the lock held by {holder} "
                                 f"(up to {self.lock_wait:g} s)")
        try:
            held = self.lock.take(gathering.script, on_busy=busy)
            output, complete = held.read_until(gathering.done, self.fact_timeout)
        except RemoteCommandError as exc:
            raise ConvergeError(f"gathering facts: {exc}") from exc
        if not complete:
            raise ConvergeError(f"gathering facts: the fact script ended early: {output.strip()[-300:]}")
        ctx = HostContext(self.target.name, self.target.vars, None, check=self.check)
        ctx.facts = gathering.parse(output)
        ctx.services = {service.name: service.for_host(conn, self.target.vars) for service in self.services}
        self._result("facts", f"gathered {len(wanted)} facts", "ok", started=started)
        self.converge(conn, ctx)

    def converge(self, conn, ctx: HostContext):
        """Every role's steps on the host in ``ctx`` (its facts gathered), then the handlers."""
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
                    ctx.notified.extend(n for n in step.notify if n not in ctx.notified)
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
                    ctx.notified.extend(n for n in step.notify if n not in ctx.notified)
            else:
                ok = False
        return ok

    def _flush(self, conn, ctx: HostContext) -> bool:
        """Run notified handlers once each, in the order their roles declare them."""
        pending, ctx.notified[:] = list(ctx.notified), []
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
        if self.lock is not None and not self.lock.holding():
            raise ConvergeError(f"the host lock {self.lock.path} was let go before {role} | "
                                f"{label} (the host heard nothing from this run for {HOST_PATIENCE_S} s): nothing "
                                f"more was done; deploy again")
        if self.observe is not None:
            self.observe(role, step, handler)
        started = time.monotonic()
        if isinstance(step, Decision):
            ctx.results.record(step.produces, step.value, f"{role} | {label}")
            if step.message:
                self._result(role, label, "ok", step.message, started=started)
            return True
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
                             f"{' (changes only if it finds something new)' if step.maybe else ''}", step.diff,
                             started=started)
                return True
            if step.throttle is not None:
                return self._throttled(conn, role, label, step, ctx, started)
            on_line = (lambda line: self.report.progress(self.target.name, role, line, step.progress)) \
                if step.progress else None
            if step.background and not self.check:
                outcome: dict = {}

                def work():
                    try:
                        outcome["result"] = self.commands(conn, step, on_line)
                    except Exception as exc:  # noqa: BLE001 - reported when joined
                        outcome["error"] = exc

                thread = threading.Thread(target=work, name=f"{self.target.name}-{label}", daemon=True)
                thread.start()
                self._background.append((step, role, label, started, thread, outcome))
                self.report.progress(self.target.name, role, f"{label}: under way, beside what follows")
                return True
            try:
                result = self.commands(conn, step, on_line)
            except RemoteCommandError as exc:
                self._result(role, label, "failed", str(exc), started=started)
                return False
            finally:
                self.report.transfer_done(self.target.name, role)
            return self._done(step, role, label, ctx, started, result)
        raise TypeError(f"unknown step {step!r}")

    def _throttled(self, conn, role: str, label: str, step: Command, ctx: HostContext, started: float) -> bool:
        """A step of a throttled kind: run when a slot is free, unless an earlier one of its
        kind failed (then neither it nor anything after it on this host runs)."""
        name = step.throttle.name
        try:
            slot = self.throttles.acquire(name, step.throttle.limit, self.control.stopping)
        except Interrupted as exc:
            raise Interrupted(f"{role} | {label} ({exc})") from None
        started = time.monotonic()  # its time is its own, not its wait for a turn
        try:
            why = self.throttles.halted.get(name)
            if why is not None:
                self._result(role, label, "skipped", f"not done: {why}; nothing more was done on this host",
                             started=started)
                return False
            try:
                result = self.commands(conn, step, None)
            except RemoteCommandError as exc:
                self.throttles.halt(name, f"{name} stopped after {self.target.name} | {label} failed")
                self._result(role, label, "failed", str(exc), started=started)
                return False
            ok = self._done(step, role, label, ctx, started, result)
            if ok:
                ctx.handlers_run.update(step.satisfies)
            else:
                self.throttles.halt(name, f"{name} stopped after {self.target.name} | {label} failed")
            return ok
        finally:
            if slot is not None:
                slot.release()

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
        if step.produces is not None:
            if not isinstance(message, Produced):
                raise TypeError(f"{role} | {label} produces {step.produces.name}: its interpret must return Produced")
            ctx.results.record(step.produces, message.value, f"{role} | {label}")
            message, changed = message.message, changed if message.changed is None else message.changed
        elif isinstance(message, tuple):  # interpret may say whether the host really changed
            message, changed = message
        if changed:
            ctx.changed_steps.append(step)
        self._result(role, label, "changed" if changed else "ok", message or step.describe, step.diff,
                     started=started)
        return True


def run(targets: list[Target], roles: list[Role], report: Report, *, check: bool = False, forks: int = 10,
        lock_name: str = "converge", lock_wait: float = 300, fact_timeout: float = 120,
        control: RunControl | None = None, services=(), serial: str | None = None,
        max_fail: str | None = None) -> Report:
    """``serial``: hosts in batches of N (or N%), each batch done before the next starts;
    the run stops after a batch where more than ``max_fail`` hosts failed (None: any)."""
    control = control or RunControl()
    throttles = Throttles()
    for service in services:
        service.start([t.name for t in targets])

    def one(target):
        HostRun(target, roles, report, check, lock_name, lock_wait, fact_timeout, control, services,
                throttles).run()

    groups = batches(targets, serial)
    with ThreadPoolExecutor(max_workers=max(1, min(forks, max(map(len, groups), default=1)))) as pool:
        for number, batch in enumerate(groups, 1):
            if control.stopping.is_set():
                break
            if len(groups) > 1:
                report.note(f"[bold]batch {number} of {len(groups)}[/bold]: {', '.join(t.name for t in batch)}")
            list(pool.map(one, batch))
            failed = [t.name for t in batch if _failed(report, t.name) and t.name not in report.advisory]
            if serial and too_many_failed(len(failed), len(batch), max_fail) and number < len(groups):
                left = [t.name for later in groups[number:] for t in later]
                why = (f"{len(failed)} of {len(batch)} hosts of batch {number} failed ({', '.join(failed)}; "
                       f"--max-fail {max_fail or 0}): the run stops here")
                for name in left:
                    report.add(TaskResult(name, "serial", "not started", "skipped", why))
                report.halted = why
                break
    return report


def _failed(report: Report, host: str) -> bool:
    recap = report.recap.get(host)
    return bool(recap and (recap.failed or recap.unreachable))
