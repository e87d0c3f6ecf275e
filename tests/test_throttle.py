"""Throttled steps (Ansible's `throttle`, run-wide): at most N at once across hosts,
the first failure stops the ones not started, a handler a step did is not run
again, and Ctrl-C while a step waits for its turn stops it there. On local hosts."""
import threading
import time

from converge.changes import Command, Role, Throttle
from converge.report import Report
from converge.runner import RunControl, Target, run
from converge.transport.local import LocalTransport


def _targets(names):
    """Local hosts, each with a host lock of its own (they are all this machine: one lock
    would run them one after another whatever the throttle says)."""
    def connect(name):
        class OwnLock(LocalTransport):
            def hold(self, script, timeout, inline=False):
                return super().hold(script.replace("dgemma-test-throttle.lock", f"dgemma-test-throttle-{name}.lock"),
                                    timeout, inline)
        return OwnLock
    return [Target(name, {}, connect(name)) for name in names]


def _rolling(log: list, failing=(), limit=1, seconds=0.3, began=None, until=None):
    """``until``: a file; a step lasts until it is there (30 s at most), not ``seconds``."""
    def plan(ctx):
        fail = "exit 1" if ctx.name in failing else "true"
        mark = f"touch {began}/{ctx.name}; " if began else ""
        wait = f"for _ in $(seq 300); do [ -e {until} ] && break; sleep 0.1; done" if until else f"sleep {seconds}"
        # each host's step says when it ran (the hosts are this machine: one clock)
        yield Command("roll", script=f"{mark}date +%s.%N; {wait}; date +%s.%N; {fail}\n", describe="roll",
                      throttle=Throttle("roll", limit),
                      satisfies=("restart",), interpret=lambda r, name=ctx.name: _noted(log, name, r))
        yield Command("after", script="true\n", describe="after")

    def handlers(ctx):
        return {"restart": Command("restart", script="true\n", describe="restart")}

    def notify(ctx):
        yield Command("change", script="true\n", describe="change", notify=("restart",))
    return [Role("change", lambda v: {}, notify), Role("roll", lambda v: {}, plan, handlers, flush_handlers=False),
            Role("flush", lambda v: {}, lambda ctx: iter(()), flush_handlers=True)]


def _noted(log, name, result):
    start, end = map(float, result.stdout.split()[:2])
    log.append((name, start, end))
    if not result.ok:
        from converge.errors import StepFailed
        raise StepFailed("gate failed")
    return "rolled"


def test_one_at_a_time_across_hosts_and_the_handler_it_did_is_not_run_again():
    log, report = [], Report(quiet=True)
    run(_targets(["a", "b", "c", "d"]), _rolling(log), report, lock_name="dgemma-test-throttle")
    assert sorted(name for name, _, _ in log) == ["a", "b", "c", "d"]
    spans = sorted((start, end) for _, start, end in log)
    assert all(later[0] >= earlier[1] for earlier, later in zip(spans, spans[1:])), spans  # never two at once
    for host in "abcd":
        tasks = [t.task for t in report.tasks if t.host == host]
        assert "roll" in tasks and "handler: restart" not in tasks, tasks


def test_no_limit_runs_them_side_by_side():
    log, report = [], Report(quiet=True)
    run(_targets(["a", "b"]), _rolling(log, limit=0, seconds=5), report, lock_name="dgemma-test-throttle")
    (_, s1, e1), (_, s2, e2) = log
    assert s2 < e1 and s1 < e2, log  # side by side


def test_the_first_failure_stops_those_not_started():
    log, report = [], Report(quiet=True)
    run(_targets(["a", "b", "c"]), _rolling(log, failing={"a", "b", "c"}), report, lock_name="dgemma-test-throttle")
    assert len(log) == 1  # one failed; the others never ran theirs
    failed = [t for t in report.tasks if t.status == "failed"]
    skipped = [t for t in report.tasks if t.task == "roll" and t.status == "skipped"]
    assert len(failed) == 1 and len(skipped) == 2
    assert all(f"roll stopped after {failed[0].host} | roll failed" in t.message for t in skipped)
    # nothing after it ran on the hosts it stopped
    assert not [t for t in report.tasks if t.task == "after"]
    assert report.recap[failed[0].host].failed == 1 and all(report.recap[t.host].failed == 0 for t in skipped)


def test_ctrl_c_while_waiting_for_a_turn_stops_there(tmp_path):
    log, report, control = [], Report(quiet=True), RunControl()
    began, stopped = tmp_path / "began", tmp_path / "stopped"
    began.mkdir()

    def ctrl_c_once_one_began():
        # one rolls, and the other two have done the step before theirs (each then waits for its
        # turn); the roll lasts until the Ctrl-C (a fixed roll of 3 s ended before the others had
        # got that far on a loaded machine, and the next one rolled)
        while not list(began.iterdir()) or len([t for t in report.tasks if t.task == "change"]) < 3:
            time.sleep(0.05)
        time.sleep(0.5)
        control.stop("interrupted (Ctrl-C)")
        stopped.touch()
    threading.Thread(target=ctrl_c_once_one_began, daemon=True).start()
    run(_targets(["a", "b", "c"]), _rolling(log, began=began, until=stopped), report,
        lock_name="dgemma-test-throttle", control=control)
    assert len(log) == 1  # the one in flight finished
    waiting = [t for t in report.tasks if t.status == "interrupted" and "roll | roll (waiting for its turn)" in t.message]
    assert len(waiting) == 2, report.tasks
    # the one that rolled stops at the next step, as any run does
    assert [t.message for t in report.tasks if t.host == log[0][0] and t.status == "interrupted"] == \
        ["interrupted (Ctrl-C): stopped before roll | after"]
