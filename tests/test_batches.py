"""--serial and --max-fail: Ansible's serial and max_fail_percentage, as pure functions
and through the engine on local hosts (a host that fails stops the batches after it)."""
import pytest

from converge.batches import BatchError, batches, parse, too_many_failed
from converge.changes import Command, Role
from converge.report import Report
from converge.runner import Target, run
from converge.transport.local import LocalTransport


def test_batches_of_a_count_or_a_percentage():
    hosts = list("abcdefg")
    assert batches(hosts, None) == [hosts]
    assert batches(hosts, "3") == [list("abc"), list("def"), ["g"]]
    assert batches(hosts, "30%") == [list("ab"), list("cd"), list("ef"), ["g"]]  # 30% of 7: 2
    assert batches(hosts, "1%") == [[h] for h in hosts]  # at least one host
    assert batches(hosts, "100%") == [hosts]
    assert batches([], "2") == []


def test_max_fail_as_ansible_counts_it():
    assert not too_many_failed(0, 4, None)
    assert too_many_failed(1, 4, None) and too_many_failed(1, 4, "0")
    assert not too_many_failed(1, 4, "1") and too_many_failed(2, 4, "1")
    assert not too_many_failed(1, 4, "25%") and too_many_failed(2, 4, "25%")
    with pytest.raises(BatchError, match="--serial 0: expected a count"):
        parse("0", "--serial")
    assert parse("0%", "--max-fail", zero=True) == (0, True)


def _role(failing: set):
    def plan(ctx):
        yield Command("work", script="exit 1\n" if ctx.name in failing else "true\n", describe="work")
    return Role("work", lambda v: {}, plan)


def _targets(names):
    return [Target(name, {}, LocalTransport) for name in names]


def test_a_failed_host_stops_the_batches_after_its_own():
    report = Report(quiet=True)
    run(_targets(["a", "b", "c", "d", "e"]), [_role({"c"})], report, serial="2", lock_name="dgemma-test-serial")
    assert report.recap["a"].changed == 1 and report.recap["c"].failed == 1 and report.recap["d"].changed == 1
    assert report.recap["e"].skipped == 1 and report.recap["e"].changed == 0
    assert report.halted.startswith("1 of 2 hosts of batch 2 failed (c; --max-fail 0)")
    assert report.as_dict()["halted"] == report.halted


def test_max_fail_lets_the_run_go_on_and_no_serial_runs_every_host():
    report = Report(quiet=True)
    run(_targets(["a", "b", "c", "d"]), [_role({"a"})], report, serial="2", max_fail="1",
        lock_name="dgemma-test-serial")
    assert report.halted is None and [report.recap[h].changed for h in "bcd"] == [1, 1, 1]
    report = Report(quiet=True)
    run(_targets(["a", "b", "c"]), [_role({"a"})], report, lock_name="dgemma-test-serial")
    assert report.halted is None and report.recap["c"].changed == 1
