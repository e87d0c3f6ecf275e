"""The programs that run on hosts are files (roles/<role>/files/*.sh, day2/host_programs/*.sh,
converge/host_scripts/*.sh) with a declared protocol (serving/host_programs.py): each passes shellcheck as dash; every marker a program's
files can print is declared by its protocol and read by its reader (taking the marker's
lines out of an output changes what the reader says); every declared marker is printed."""
import ast
import base64
import json
import re
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from serving import leftovers

from converge import hostlock
from converge.changes import WRITE_FILE
from converge.facts import GATHER
from converge.verify import CheckShell
from serving.haproxy.reach import REACH_PROGRAM
from serving.relay_probe import PING_PROGRAM
from converge.errors import StepFailed
from converge.transport import Result
from day2 import logs, readings, top, usage
from serving import prune
from roles.frontdoor.back import BACK, BACK_PROGRAM
from roles.gateway.usage_steps import USAGE_RUNNING, USAGE_RUNNING_PROGRAM, _interpret as usage_reader
from serving.haproxy.steps import ANSWERING, ANSWERING_PROGRAM, _interpret as answering_reader
from serving.haproxy.instance import FRONTDOOR
from serving import container_unit, systemd
from roles.exporters import role as exporters
from roles.shared_address import role as shared_address
from serving.host_programs import Program
from roles.image.role import INSPECT_PROGRAM, MANIFEST_PROGRAM as IMAGE_MANIFEST_PROGRAM, PULL_PROGRAM
from roles.weights.cache import CACHE_PROGRAM
from serving.replicas import replica
from roles.service import rollout
from roles.service.rollout import PROGRAM as ROLL_PROGRAM, ROLL, Roll
from roles.start.role import PROGRAM as START_PROGRAM, RECORD_PROGRAM, START
from roles.weights.download import (FETCH, FETCH_PROGRAM, MANIFEST, MANIFEST_PROGRAM, HubFile, Manifest,
                                    parse_manifest, progress_reader)
from tests.conftest import ROOT

FACT_LIBRARIES = sorted([*(ROOT / "converge" / "facts" / "files").glob("*.sh"), *(ROOT / "roles").glob("*/files/facts.sh"),
                         *(ROOT / "serving").glob("*/files/facts.sh")])
COLLECTOR = Program((ROOT / "roles" / "exporters" / "files" / "collector.sh",))
SYSTEMD = Program((systemd.SYSTEMD_FILE,))
FOLDERS = systemd.FOLDERS_PROGRAM

HOST_LOCK = Program((hostlock.SCRIPT,))  # the engine's own
PROGRAMS = {"roll": ROLL_PROGRAM, "start": START_PROGRAM, "answering": ANSWERING_PROGRAM, "back": BACK_PROGRAM,
            "collector": COLLECTOR, "usage-running": USAGE_RUNNING_PROGRAM, "hostlock": HOST_LOCK,
            "weights-manifest": MANIFEST_PROGRAM, "weights-fetch": FETCH_PROGRAM,
            "image-pull": PULL_PROGRAM, "image-manifest": IMAGE_MANIFEST_PROGRAM, "image-inspect": INSPECT_PROGRAM, "weights-cache": CACHE_PROGRAM,
            "container-pull": container_unit.PULL_PROGRAM, "container-answering": container_unit.ANSWERING_PROGRAM,
            "systemd": SYSTEMD, "folders": FOLDERS, "collector-running": exporters.COLLECTOR_RUNNING_PROGRAM,
            "shared-address-answering": shared_address.ANSWERING_PROGRAM,
            "keepalived-install": shared_address.INSTALL_PROGRAM,
            # libraries of facts' functions, the engine's (converge/facts/files) and the roles'
            **{f"facts-{p.parent.parent.name}-{p.stem}": Program((p,)) for p in FACT_LIBRARIES},
            "write-file": Program((WRITE_FILE,)), "relay-ping": PING_PROGRAM, "gather": Program((GATHER,)),
            "front-doors-reached": REACH_PROGRAM,
            "check-shell": Program((CheckShell.SCRIPT,)),
            # day 2's readings: each ends in one result line (tests/test_day2_programs.py runs and reads them)
            "day2-replicas": readings.REPLICAS_PROGRAM, "day2-serving-host": readings.SERVING_HOST_PROGRAM, "day2-gateway": readings.GATEWAY_PROGRAM,
            "day2-alerts": readings.ALERTS_PROGRAM, "day2-prometheus": top.PROMETHEUS_PROGRAM,
            "day2-journal": logs.JOURNAL_PROGRAM, "day2-usage-days": usage.USAGE_DAYS_PROGRAM,
            "day2-records": usage.RECORDS_PROGRAM, "day2-prune-facts": prune.FACTS_PROGRAM,
            "day2-prune": prune.REMOVE_PROGRAM, "start-record-release": RECORD_PROGRAM,
            "leftovers-removed": leftovers.PROGRAM}


def test_every_host_program_file_belongs_to_a_program():
    files = {p for p in (ROOT / "roles").glob("*/files/*.sh")} | set((ROOT / "serving").glob("files/*.sh")) \
        | set((ROOT / "serving").glob("*/files/*.sh")) \
        | set((ROOT / "converge" / "host_scripts").glob("*.sh")) | set((ROOT / "day2" / "host_programs").glob("*.sh")) \
        | set((ROOT / "converge" / "facts" / "files").glob("*.sh"))
    used = {Path(f) for program in PROGRAMS.values() for f in program.files}
    assert files - used == set(), "a host program that no test checks"


@pytest.mark.parametrize("name", sorted(PROGRAMS))
def test_the_program_passes_shellcheck_as_dash(name, tmp_path):
    if not shutil.which("shellcheck"):
        pytest.fail("shellcheck is not installed: ./run.sh test installs it (apt-get install shellcheck)")
    script = tmp_path / f"{name}.sh"
    script.write_text(PROGRAMS[name].text())
    # SC2317: a library's functions look unreachable to a checker that sees no caller
    proc = subprocess.run(["shellcheck", "-s", "dash", "-S", "style", "-e", "SC2317", "-f", "gcc", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("name", sorted(set(PROGRAMS) - {"collector", "hostlock", "systemd", "folders",
                                                          "keepalived-install", "day2-usage-days", "day2-records",
                                                          "write-file", "relay-ping", "front-doors-reached", "gather", "check-shell",
                                                          "leftovers-removed"}
                                             - {n for n in PROGRAMS if n.startswith("facts-")}))
def test_what_a_program_prints_is_what_its_protocol_declares(name):
    program = PROGRAMS[name]
    assert program.printed_markers() == program.protocol.declared()


# ---------------------------------------------------------------- each marker is read


def _outcome(read, rc: int, lines: list[str]):
    try:
        said = read(Result(rc, "\n".join(lines) + "\n", ""))
    except StepFailed as exc:
        return ("failed", str(exc))
    return ("said", getattr(said, "message", said), getattr(said, "value", None))


def _roll(action="restart", replicas=1, **change) -> Roll:
    targets = tuple(replica({}, i, gpus=(f"GPU-{i}",)) for i in range(1, replicas + 1))
    fields = dict(host="hgx01", runtime="podman", action=action, replicas=targets, env_path="/etc/dgemma/x.env",
                  api_port=8000, frontdoor_address="127.0.0.1", drain_timeout=120, ready_timeout=600, alone=False)
    return Roll(**{**fields, **change})


U1, U2 = replica({}, 1).unit, replica({}, 2).unit
DEPLOY = dict(unit_file=SimpleNamespace(), unit_path="/etc/systemd/system/x.service", image="img:tag",
              same_image_ref=True)
def _rolled(outcome: str, ms: int, why: str = "", units: str = "", failed_ms="", again: str = "", ready_ms="") -> str:
    """roll.sh's result line."""
    return "@result " + json.dumps({"outcome": outcome, "ms": ms, "why": why, "units": units, "failed_ms": failed_ms,
                                    "again": again, "ready_ms": ready_ms})


# (the roll, its exit status, what it printed): each way a roll ends, as roll.sh says it
ROLLS = [
    (_roll(replicas=2), 0, ["@begin 0", "@drained 400 0", f"@replica-ready {U1} 1900", f"@replica-ready {U2} 2100",
                            "@gate-passed 1 the front door", "@gate-passed 2 the front door",
                            "@in-service 1 3000", "@in-service 2 3000", _rolled("done", 3000, ready_ms=2100)]),
    (_roll(replaces=replica({}, 1, "gemma4")), 0,
     ["@begin 0", "@drained 10 0", f"@replica-ready {U1} 2000", "@gate-passed 1 the front door",
      "@replaced podman-vllm-gemma4-1.service", "@in-service 1 2600", _rolled("done", 2600, ready_ms=2000)]),
    (_roll(**DEPLOY), 5, ["@begin 0", "@drained 10 0", "  | ERROR EngineCore", "@retagged",
                          f"@replica-ready {U1} 5000", "@gate-passed 1 the front door", "@in-service 1 16000",
                          _rolled("rolled-back", 16000, "a chat completion answered 500", failed_ms=9000,
                                  ready_ms=5000)]),
    (_roll(**DEPLOY), 6, ["@begin 0", "@no-frontdoor",
                          _rolled("rollback-failed", 200, "its container exited", U1, 100, "its container exited again")]),
    (_roll(alone=True), 0, ["@begin 0", "@no-frontdoor", f"@replica-ready {U1} 2000",
                            "@gate-passed 1 loopback", _rolled("done", 2100, ready_ms=2000)]),
    (_roll("stop"), 0, ["@begin 0", "@drained 10 0", "@stopped 5000", "@in-service 1 5100", _rolled("done", 5100)]),
    # invoke tune's trial: gated, then held out of service
    (_roll(hold=True, **DEPLOY), 0, ["@begin 0", "@drained 10 0", f"@replica-ready {U1} 2000",
                                     "@gate-passed 1 the front door", "@held 1", _rolled("done", 2400, ready_ms=2000)]),
    (_roll("remove"), 0, ["@begin 0", "@drained 10 0", "@removed 400", "@in-service 1 500", _rolled("done", 500)]),
    (_roll("recover"), 0, ["@begin 0", "@drained 10 0", "@cleared 1 123 456", f"@replica-ready {U1} 3000",
                           "@gate-passed 1 the front door", "@in-service 1 3500", _rolled("done", 3500, ready_ms=3000)]),
    (_roll("recover"), 4, ["@begin 0", "@drained 10 0", "@in-service 1 900",
                           _rolled("failed", 900, "replica 1: the container is still there", failed_ms=800)]),
    (_roll("stop"), 4, ["@begin 0", "@drained 10 0", "@in-service 1 900",
                        _rolled("failed", 900, "systemctl stop failed", failed_ms=800)]),
    (_roll(**DEPLOY), 7, ["@begin 0", "@drained 10 0", "@in-service 1 100", _rolled("write-failed", 100)]),
    (_roll(), 0, ["@begin 0", "@drained 10 0", f"@replica-ready {U1} 2000",
                  "@gate-passed 1 the front door", "@undrain-failed 1 replica1", _rolled("done", 2500, ready_ms=2000)]),
    (_roll(), 0, ["@begin 0", "@drained 10 0", f"@replica-ready {U1} 2000",
                  "@gate-passed 1 the front door", "@in-service 1 2500", "@unflag-failed flag",
                  _rolled("done", 2500, ready_ms=2000)]),
    (_roll("start", replicas=2), 4, ["@begin 0", "@no-frontdoor",
                                     _rolled("failed", 3000, "its container exited after 3 s (failed/failed)", U2,
                                             3000)]),
    (_roll("start", replicas=2), 4, ["@begin 0", "@no-frontdoor", f"@replica-ready {U1} 900",
                                     _rolled("failed", 600000, "no answer within 600 s", U2, 600000)]),
    # a host's last replica behind the gateways: they had it out once each had checked it again, or
    # after the most a check takes
    (_roll(), 0, ["@begin 0", "@gateways-saw seen 800", "@drained 900 0", f"@replica-ready {U1} 2000",
                  "@gate-passed 1 the front door", "@in-service 1 2500", _rolled("done", 2500, ready_ms=2000)]),
    (_roll("stop"), 0, ["@begin 0", "@gateways-saw waited 3500", "@drained 3600 0", "@stopped 5000",
                        "@in-service 1 5100", _rolled("done", 5100)]),
    # a roll cut off before it said how it ended (its host rebooted, sh was killed)
    (_roll(), 137, ["@begin 0", "@drained 10 0"]),
    # another roll of the host under way (its run had lost its link): waited for, then this one
    (_roll(), 0, ["@waited 4200", "@begin 4200", "@drained 10 0", f"@replica-ready {U1} 6000",
                  "@gate-passed 1 the front door", "@in-service 1 6500", _rolled("done", 6500, ready_ms=1800)]),
    (_roll(), 4, [_rolled("failed", 120000, "another roll of this host's replicas was still under way after 120 s",
                          failed_ms=120000)]),
]


def _start_reader(units=(U1, U2)):
    from roles.start.role import plan
    from converge.changes import HostContext
    from serving.handoffs import UNITS, UnitPlan, Units
    from serving.replicas import Served
    plans = tuple(UnitPlan(Served(replica({}, i), "m", 0.7), "diffusiongemma", ("diffusiongemma",), "", "")
                  for i in (1, 2))
    ctx = HostContext("hgx01", {}, {"replica_units": {}})
    ctx.results.record(UNITS, Units(plans, "unit", "img"), "service")
    return next(plan(ctx)).interpret


def _started(state: str, ms: int, units: str = "", how: str = "") -> str:
    return "@result " + json.dumps({"state": state, "ms": ms, "units": units, "how": how})


STARTS = [
    (0, [f"@replica-ready {U1} 1900", f"@replica-ready {U2} 2100", _started("ready", 2100)]),
    (0, [f"@replica-ready {U1} 1900", _started("ready", 1900)]),
    (3, ["  | no such unit", _started("start-failed", 0, how="systemctl start failed")]),
    (3, ["  | exited", _started("failed", 3000, U2, "failed/failed")]),
    (4, [f"@replica-ready {U1} 900", _started("timeout", 600000, U2)]),
    (4, [_started("timeout", 600000, f"{U1} {U2}")]),
]


def _answered(state: str, seconds: int, unit_state: str = "active", answered: str = "new", files: str = "") -> str:
    return "@result " + json.dumps({"state": state, "seconds": seconds, "unit_state": unit_state,
                                    "answered": answered, "files": files})


ANSWERS = [
    (0, [_answered("ready", 1)]),
    (0, ["@reload-signalled-again old", _answered("ready", 4)]),
    (0, ["@reload-signalled-again old", "@reload-did-not-take old", _answered("ready", 11)]),
    (0, ["@handed-off 10.0.0.200", _answered("ready", 2)]),
    (3, ["  | [ALERT] bad config", _answered("failed", 2, "failed", "")]),
    (4, [_answered("timeout", 60, "active", "old", "new")]),
]


def _cases():
    for roll, rc, lines in ROLLS:
        yield ROLL, rollout.interpret(roll), rc, lines
    for rc, lines in STARTS:
        yield START, _start_reader(), rc, lines
    for rc, lines in ANSWERS:
        yield ANSWERING, answering_reader(FRONTDOOR, "u.service", 60, "answers"), rc, lines
    from roles.frontdoor.role import back_in_service
    from converge.changes import HostContext
    ctx = HostContext("rtx01", {}, {"frontdoor_servers": {"replica1": {"status": "DRAIN", "in_flight": 0}}})
    for rc, said in [(0, ("replica1", "", "")), (1, ("", "replica1", "")), (1, ("replica1", "", "flag_gemma4")),
                     (1, ("", "replica1", "flag"))]:
        yield BACK, back_in_service(ctx).interpret, rc, ["@result " + json.dumps(dict(zip(
            ("in_service", "refused", "flags_refused"), said)))]
    for rc, lines in [(0, ['@result {"state": "ready", "seconds": 1, "unit_state": "active"}']),
                      (3, ["  | Traceback", '@result {"state": "failed", "seconds": 2, "unit_state": "failed"}']),
                      (4, ['@result {"state": "timeout", "seconds": 30, "unit_state": "activating"}'])]:
        yield USAGE_RUNNING, usage_reader("was inactive", waited=True), rc, lines
    for rc, lines in [(0, ['@result {"state": "ready", "seconds": 2}']),
                      (3, ["  | collector.sh: nvidia-smi: not found", '@result {"state": "failed", "seconds": 1}']),
                      (4, ['@result {"state": "timeout", "seconds": 60}'])]:
        yield exporters.COLLECTOR_RUNNING, exporters._collector_running("was inactive", 60), rc, lines
    for rc, lines in [(0, ['@result {"state": "answers", "code": 200, "holder": "yes"}']),
                      (0, ['@result {"state": "answers", "code": 404, "holder": "no"}']),
                      (3, ['@result {"state": "silent", "code": 0, "holder": "no"}'])]:
        yield shared_address.ANSWERING, shared_address._interpret("10.0.0.200", 8000, 60), rc, lines
    from serving.container_unit import _interpret as container_reader
    for rc, lines in [(0, ['@result {"state": "ready", "seconds": 0}']), (0, ['@result {"state": "ready", "seconds": 4}']),
                      (3, ["  | level=error", '@result {"state": "failed", "seconds": 1}']),
                      (4, ['@result {"state": "timeout", "seconds": 30}'])]:
        yield container_unit.ANSWERING, container_reader("u.service", 30, "was inactive"), rc, lines
    for rc, lines in FETCHES:
        yield FETCH, _fetch_reader(relayed="@relay-failed" in lines[0]), rc, lines
    for lines in MANIFESTS:
        yield MANIFEST, _manifest_reader, 0, lines


B1, B2, COMMIT = "a" * 64, "b" * 40, "c" * 40
WEIGHTS = Manifest("org/m", "main", COMMIT, (HubFile("m.safetensors", 2 << 20, B1, True), HubFile("c.json", 9, B2, False)))
def _fetched(outcome: str, commit: str = "", need: int = 2097161, free: int = 10 << 30) -> str:
    return "@result " + json.dumps({"outcome": outcome, "commit": commit, "need": need, "free": free})


def _listed(revision_status, revision: str, commit: str = "", pages=(), why: str = "") -> list[str]:
    """manifest.sh's result: the revision's answer, the commit, each page of the tree (status, body)."""
    b64 = lambda text: base64.b64encode(text.encode()).decode()  # noqa: E731
    return ["@result " + json.dumps({"revision_status": revision_status, "revision": b64(revision), "commit": commit,
                                     "tree_status": " ".join(str(code) for code, _ in pages),
                                     "tree": " ".join(b64(body) for _, body in pages), "why": why})]


FETCHES = [  # (exit status, what fetch.sh printed), each way it ends
    (0, ["@bytes 0", "@bytes 1048576", f"@corrupt {B1} {'0' * 64}", f"@bytes {(2 << 20) + 9}",
         _fetched("complete", COMMIT)]),
    (0, [f"@relay-failed {B1}", _fetched("complete", COMMIT)]),
    (3, [f"@partial {B1} 1048576 2097152 28 curl: (28) Operation too slow", f"@failed {B1}", _fetched("failed")]),
    (3, [f"@partial {B1} 0 2097152 7 curl: (7) refused", f"@failed {B1}", f"@failed {B2}", _fetched("failed")]),
    (3, [f"@busy {B1}", _fetched("failed")]),
    (4, [_fetched("no-space", need=2097161, free=1000)]),
    (5, ["mkdir: cannot create directory '/srv/hf/hub': Permission denied", _fetched("no-folder", need=0, free=0)]),
    (0, ["@bytes 0", f"@bytes {(2 << 20) + 9}"]),  # cut off before its end
]
MANIFESTS = [  # what manifest.sh said: the revision, the commit, pages of the tree
    _listed(200, json.dumps({"sha": COMMIT}), COMMIT, [(200, json.dumps([{"type": "file", "path": "c.json", "size": 9,
                                                                          "oid": B2}]))]),
    _listed(200, json.dumps({"sha": COMMIT}), COMMIT,
            [(200, json.dumps([{"type": "file", "path": "c.json", "size": 9, "oid": B2}])),
             (200, json.dumps([{"type": "file", "path": "m.safetensors", "size": 2 << 20, "oid": B2,
                                "lfs": {"oid": B1, "size": 2 << 20}}]))]),
    _listed(404, "{}"),
    _listed("error", "", why="curl: (6) Could not resolve host: hub.test"),
    _listed(200, json.dumps({"sha": COMMIT}), COMMIT, [(200, "[]"), (500, "oops")]),
    ["curl: (7) refused"],  # no result: cut off
]


def _fetch_reader(relayed: bool):
    """The download step's reader, and the progress its @bytes lines show."""
    from roles.weights.role import read_fetch
    interpret = read_fetch("org/m", WEIGHTS, "/srv/hf", "https://hub.test", relayed_through=relayed)
    progress = progress_reader(WEIGHTS.total)

    def read(result):
        shown = [p.done for p in map(progress, result.stdout.splitlines()) if p is not None]
        try:
            said = interpret(result)
        except StepFailed as exc:
            said = f"failed: {exc}"
        return f"{said} (progress {shown})"
    return read


def _manifest_reader(result):
    try:
        manifest = parse_manifest(result.stdout, "org/m", "main", "https://hub.test")
    except StepFailed as exc:
        return f"failed: {exc}"
    return f"{manifest.commit} {[f.path for f in manifest.files]}"


@pytest.mark.parametrize("protocol", [ROLL, START, ANSWERING, BACK, USAGE_RUNNING, FETCH, MANIFEST,
                                      exporters.COLLECTOR_RUNNING, shared_address.ANSWERING],
                         ids=lambda p: p.name)
def test_every_marker_changes_what_its_reader_says(protocol):
    """For each declared marker, an output that carries it, read with and without its lines:
    the reader says something else without them (it reads the marker)."""
    cases = [(read, rc, lines) for proto, read, rc, lines in _cases() if proto is protocol]
    unread = []
    for marker in protocol.markers:
        with_it = [(read, rc, lines) for read, rc, lines in cases if any(l.startswith(f"@{marker}") for l in lines)]
        assert with_it, f"no case prints @{marker}: add one"
        if not any(_outcome(read, rc, lines) != _outcome(read, rc, [l for l in lines if not (
                l == f"@{marker}" or l.startswith(f"@{marker} "))]) for read, rc, lines in with_it):
            unread.append(marker)
    assert not unread, f"{protocol.name}: its reader says the same without these markers: {unread}"


@pytest.mark.parametrize("protocol", [USAGE_RUNNING, exporters.COLLECTOR_RUNNING, shared_address.ANSWERING,
                                      container_unit.ANSWERING, ANSWERING, ROLL, START, BACK, FETCH, MANIFEST],
                         ids=lambda p: p.name)
def test_each_result_a_program_ends_with_is_read_and_said_apart(protocol):
    """The cases of each way the program ends (its result line): each is read (a result without the
    line is refused by name), and no two say the same."""
    cases = [(read, rc, lines) for proto, read, rc, lines in _cases() if proto is protocol]
    said = [_outcome(read, rc, lines) for read, rc, lines in cases]
    assert len(set(said)) == len(said), said
    for read, rc, lines in cases:
        without = _outcome(read, rc, [line for line in lines if not line.startswith("@result ")])
        # (the weights' readers in these tests say a failure as text: "failed: ...")
        assert (without[0] == "failed" or str(without[1]).startswith("failed: ")) and "result" in without[1], without


def test_a_replica_its_front_door_will_not_put_back_fails_the_roll_naming_it_and_the_mend():
    roll, rc, lines = next(case for case in ROLLS if "@undrain-failed 1 replica1" in case[2])
    with pytest.raises(StepFailed, match=r"refused to put replica 1 \(replica1\) back in service.*"
                                         r"invoke recover --hosts hgx01 --replica 1"):
        rollout.interpret(roll)(Result(rc, "\n".join(lines) + "\n", ""))


# ---------------------------------------------------------------- the replica table


@pytest.mark.parametrize("shell", ["dash", "sh"])
def test_the_replica_table_is_read_on_the_host_by_name_as_it_is_written(shell):
    """serving/replicas.py writes the table; serving/files/replicas.sh reads it by field name, whatever the
    order of a line's words (here reversed), a GPU list or none."""
    from serving.replicas import TABLE_FIELDS, TABLE_READER, read_table, shell_table
    written = shell_table([replica({}, 0), replica({}, 2, "gemma4", ["GPU-b", "GPU-a"]),
                           replica({"container_runtime": "docker"}, 3, "gemma4")])
    rows = read_table(written)
    assert [list(row) for row in rows] == [list(TABLE_FIELDS)] * 3
    assert rows[1] == {"index": "2", "unit": "podman-vllm-gemma4-2.service", "container": "vllm-gemma4-2",
                       "port": "8102", "server": "replica2", "gpus": "GPU-a,GPU-b"}
    reordered = "\n".join(" ".join(reversed(line.split())) for line in written.splitlines())
    for table in (written, reordered):
        probe = ("for i in $(table_field index \"$T\"); do use_replica \"$i\" \"$T\"; "
                 "printf '%s|%s|%s|%s|%s|%s\\n' \"$I\" \"$U\" \"$C\" \"$P\" \"$S\" \"$WANT_GPUS\"; done; "
                 "table_pairs unit port \"$T\"")
        proc = subprocess.run([shell, "-c", "".join(p.read_text() for p in TABLE_READER) + probe], env={"T": table, "PATH": "/usr/bin:/bin"},
                              capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, proc.stderr
        lines = proc.stdout.splitlines()
        assert lines[:3] == ["|".join([r["index"], r["unit"], r["container"], r["port"], r["server"],
                                       r["gpus"].replace(",", " ")]) for r in rows]
        assert lines[3:] == [f"{r['unit']}={r['port']}" for r in rows]
    with pytest.raises(ValueError, match="blank"):
        shell_table([replica({"service_name": "a b"}, 0)])


# ---------------------------------------------------------------- no host shell in Python

# what looks like shell a host runs, in a Python string
# (its structure: words for a person may name a command, a program's script is checked by its plan cases)
SHELL = re.compile(r"; then|\$\(|&&|\|\||printf '|2>/dev/null|\| ?(awk|sed|grep|tail|head|cut)\b|"
                   r"\[ -[a-zA-Z] |\bfor \w+ in |; do\b|\bmktemp\b|>/dev/null|<<'|\bsh -[sc]\b")
SOURCES = ("converge", "roles", "serving", "day2", "relay", "credentials", "kubernetes_manifests", "lab_tasks", "tasks.py")
# (file, how the string begins): the shell that stays in Python, and why
ALLOWED = {
    ("kubernetes_manifests/render.py", "# The fleet for Kubernetes"): "the render's README: the steps a person types "
                                                                      "in a shell of theirs, not a program a host runs",
    ("converge/transport/__init__.py", "sh -c "): "the exec request's command line that starts our shell",
    ("converge/transport/__init__.py", "sh -s"): "the exec request's command line that starts our shell",
    ("converge/become.py", "sh -s"): "sudo's command line, which starts our shell as the become user",
    ("converge/become.py", "sh -c "): "sudo's command line, which starts our shell as the become user",
    ("converge/become.py", "while IFS= read -r l; do"): "sudo's command line: the password line skipped",
    ("converge/become.py", "LC_ALL=C sudo -S"): "sudo's command line, which starts our shell as the become user",
    ("converge/hostlock.py", "while l=$(timeout "): "the held script's last line, which also ends a script "
                                                    "held without the lock (the lab's transport tests)",
    ("converge/changes.py", " <<'__CONVERGE_EOF__'"): "a file's content, as the heredoc of write_file's call",
    # words for a person that read as shell
    ("roles/preflight/role.py", "docker has no nvidia runtime"): "the fix a failed check names",
    ("kubernetes_manifests/monitoring.py", "raise the replicaCount"): "the fix an alert names",
}


def _strings(node, skip):
    for child in ast.iter_child_nodes(node):
        if id(child) in skip:
            continue
        if isinstance(child, ast.JoinedStr):
            yield child, "".join(v.value for v in child.values if isinstance(v, ast.Constant))
            continue
        if isinstance(child, ast.Constant) and isinstance(child.value, str):
            yield child, child.value
        yield from _strings(child, skip)


def test_no_shell_a_host_runs_is_built_in_a_python_string():
    """Every program a host runs is a file (this module's PROGRAMS, the facts' libraries): a string
    in our Python that looks like shell is one of ALLOWED, a docstring, or words for a person (a
    step's describe, a message, an error)."""
    found = []
    for source in SOURCES:
        base = ROOT / source
        for path in ([base] if base.is_file() else sorted(base.rglob("*.py")) if base.exists() else []):
            rel = str(path.relative_to(ROOT))
            if "/tests/" in rel or path.name == "conftest.py":
                continue
            tree = ast.parse(path.read_text())
            skip = set()
            for node in ast.walk(tree):
                body = getattr(node, "body", None)
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and body and \
                        isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                    skip.add(id(body[0].value))
                if isinstance(node, ast.keyword) and node.arg in ("describe", "message", "why"):
                    skip.add(id(node.value))
                if isinstance(node, ast.Raise) and node.exc is not None:
                    skip.add(id(node.exc))
            for node, text in _strings(tree, skip):
                if SHELL.search(text) and not any(rel == f and text.startswith(start) for f, start in ALLOWED):
                    found.append(f"{rel}:{node.lineno}: {text[:80]!r}")
    assert found == [], "shell a host runs, built in Python: make it a program file\n" + "\n".join(found)


@pytest.mark.parametrize("shell", ["dash", "bash"])
def test_a_result_line_is_json_whatever_its_values_hold(shell):
    """result.sh: numbers stay numbers; a text with quotes, backslashes, tabs, line breaks and other
    control characters is still one line of JSON, each of them made harmless, the rest kept."""
    from serving.host_programs import RESULT_LIBRARY, Protocol
    hostile = 'it said "no"\\ then\tstopped\nhere \x01(500: {"error": 1}) 100% $HOME `id`'
    script = RESULT_LIBRARY.read_text() + 'result state=failed ms=1200 zero=0 lead=007 why="$WHY" empty=\n'
    out = subprocess.run([shell, "-c", script], env={"WHY": hostile, "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=30).stdout
    assert out.count("\n") == 1
    said = Protocol("p", result=dict.fromkeys(["state", "ms", "zero", "lead", "why", "empty"], "")).result_of(out)
    assert said == {"state": "failed", "ms": 1200, "zero": 0, "lead": "007", "empty": "",
                    "why": "it said 'no'/ then stopped here (500: {'error': 1}) 100% $HOME `id`"}


# ---------------------------------------------------------------- the facts' markers

def _fact_cases():
    """A marker the facts' libraries print -> what reads it, and an output (a capture where there is
    one) that carries it."""
    from converge.facts import FactError
    from converge.facts.containers import ImagePresent, Images, parse_runtimes
    from converge.facts.host import FILE_STATES, FileState, TextFiles, UnitFiles
    from converge.facts.nvidia import parse_nvidia_smi_sections
    from tests.conftest import FIXTURES

    def reading(process):
        def read(output):
            try:
                return process(output)
            except FactError as exc:
                return f"FactError: {exc}"
        return read
    h100 = FIXTURES / "nvidia-smi" / "h100"
    smi = (f"@query 0\n{(h100 / 'busy-query.csv').read_text()}@version 0\n{(h100 / 'idle-version.txt').read_text()}"
           f"@apps 0\n{(h100 / 'busy-compute-apps.csv').read_text()}")
    docker = '@docker Docker version 24.0.7\n@docker-runtimes {"nvidia":{},"runc":{}}\n@nvidia-hook /usr/bin/hook\n'
    units = (FIXTURES / "systemd" / "unit-files-hgx01.txt").read_text()
    return {"podman": (reading(parse_runtimes), "@podman podman version 4.3.1\n"),
            "docker": (reading(parse_runtimes), docker), "docker-runtimes": (reading(parse_runtimes), docker),
            "nvidia-hook": (reading(parse_runtimes), docker),
            # the Engine API's /info, as the lab's spark01 answered it
            "docker-api": (reading(parse_runtimes), (FIXTURES / "docker-api" / "runtimes-spark01-api.txt").read_text()),
            "cdi": (reading(parse_runtimes), "@podman podman version 4.3.1\n@cdi /etc/cdi/nvidia.yaml\n"),
            "absent": (reading(lambda o: Images("podman").process(o, 0)), "@absent\n"),
            "index": (reading(lambda o: ImagePresent("podman", "10.0.0.1:5000/v/v:t").process(o, 0)), "@index 0\n"),
            "rc": (reading(lambda o: ImagePresent("docker", "v/v:t").process(o, 0)), "@rc 0\n"),
            "file": (reading(lambda o: TextFiles("/etc/nixos/*.nix").process(o, 0)), "@file /etc/nixos/a.nix\nYQ==\n"),
            "unit": (reading(lambda o: UnitFiles("/etc/systemd/system/*.service").process(o, 0)), units),
            "state": (reading(lambda o: UnitFiles("/etc/systemd/system/*.service").process(o, 0)), units),
            # a batch of file states (fact_file_states): a link's own answer, the others' stat lines and bytes
            **{marker: (reading(lambda o: FILE_STATES[False].split(o, 0, [FileState("/etc/a"), FileState("/etc/b")])),
                        "@one /etc/a\n777 root root 4\nYQ==\n@one-end\n@state 644 root root 1 /etc/b\n@content\nYg==\n")
               for marker in ("one", "one-end", "content")},
            "hashes": (reading(lambda o: FILE_STATES[True].split(o, 0, [FileState("/etc/k", secret=True)])),
                       "@state 600 root root 3 /etc/k\n@hashes\n" + "ab" * 32 + "  /etc/k\n"),
            **{marker: (reading(parse_nvidia_smi_sections), smi) for marker in ("query", "version", "apps")},
            "missing": (reading(parse_nvidia_smi_sections), "@missing\n")}


def test_every_marker_a_fact_library_prints_is_declared_beside_its_readers_and_read():
    """The facts' libraries print their tools' own output between markers, which the facts' pure
    parsers read: each library's markers are declared in its module (MARKERS), and each changes
    what its reader makes of a capture when its lines are taken out."""
    from converge.facts import LIBRARIES, containers, host, nvidia
    cases = _fact_cases()
    for module in (containers, host, nvidia):
        library = LIBRARIES / f"{module.__name__.rsplit('.', 1)[-1]}.sh"
        assert Program((library,)).printed_markers() == set(module.MARKERS), library
        for marker in module.MARKERS:
            read, output = cases[marker]
            without = "".join(line for line in output.splitlines(keepends=True)
                              if not (line.rstrip("\n") == f"@{marker}" or line.startswith(f"@{marker} ")))
            assert without != output, f"the case for @{marker} does not print it"
            assert read(output) != read(without), f"{library.name}: its reader says the same without @{marker}"
    for library in sorted((ROOT / "roles").glob("*/files/facts.sh")):
        assert Program((library,)).printed_markers() == set(), f"{library}: declare its markers"


def test_a_replica_unit_s_start_notes_pass_shellcheck_and_quote_every_path(tmp_path):
    """The one shell a unit holds (templates/start_notes.sh.j2, its ExecStartPre= and NixOS's
    preStart), rendered for a service whose name needs quoting: shellcheck as dash, and run."""
    import os
    from roles.service.role import start_notes
    notes = start_notes({"service_name": "vllm-diffusiongemma"}, replica({}, 1))
    assert "'" not in notes  # plain paths need no quotes; a path that needs them gets them (shlex)
    script = tmp_path / "notes.sh"
    script.write_text(notes + "\n")
    if not shutil.which("shellcheck"):
        pytest.fail("shellcheck is not installed: ./run.sh test installs it (apt-get install shellcheck)")
    proc = subprocess.run(["shellcheck", "-s", "dash", "-S", "style", "-f", "gcc", str(script)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
    # run under dash, its /run and /etc moved into the test's folder
    moved = notes.replace("/run/dgemma", str(tmp_path / "run")).replace("/etc/dgemma", str(tmp_path / "etc")) \
        .replace("/var/lib/dgemma", str(tmp_path / "lib"))
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "vllm-diffusiongemma.env").write_text("VLLM_API_KEY=k\n")
    assert subprocess.run(["dash", "-c", moved], timeout=30, env=dict(os.environ)).returncode == 0
    written = sorted(p.name for p in (tmp_path / "run").iterdir())
    assert written == [f"{replica({}, 1).container}.env-started"]  # no image record yet: no image note
