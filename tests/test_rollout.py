"""A replica's roll (roles/service/rollout.py) without hosts: its limit across the
fleet, its script as the host's /bin/sh reads it, and what the report says of each
way it can end (the lab runs it for real: tests/lab/test_lab_rollout.py)."""
import json
import shutil
import subprocess

import pytest

from converge.changes import File
from converge.errors import StepFailed
from converge.transport import Result
from serving.replicas import replica
from roles.service.rollout import Roll, interpret, script, throttle


def _roll(**changes) -> Roll:
    unit = File("unit file", path="/etc/systemd/system/podman-vllm-diffusiongemma-1.service",
                content="[Service]\nExecStart=/usr/bin/podman run x\n", current=None)
    fields = dict(host="hgx01", runtime="podman", action="restart",
                  replicas=(replica({}, 1, gpus=("GPU-b", "GPU-a")),),
                  env_path="/etc/dgemma/vllm-diffusiongemma.env", unit_file=unit, unit_path=unit.path,
                  image="10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130", same_image_ref=True,
                  api_port=8000, frontdoor_address="127.0.0.1",
                  drain_timeout=120, ready_timeout=600, alone=False)
    fields.update(changes)
    return Roll(**fields)


def test_one_replica_of_the_fleet_at_a_time_behind_a_gateway():
    assert throttle({}, has_gateway=True).limit == 1
    assert throttle({}, has_gateway=False).limit == 0  # each host one at a time, hosts side by side
    assert throttle({"rollout_concurrency": 3}, has_gateway=True).limit == 3


@pytest.mark.parametrize("shell", ["sh", "dash", "bash"])
@pytest.mark.parametrize("write", [True, False])
def test_the_script_is_one_the_hosts_shell_reads(shell, write):
    if not shutil.which(shell):
        pytest.skip(f"{shell} is not installed")
    text = script(_roll(unit_file=_roll().unit_file if write else None))
    assert script(_roll(action="stop", unit_file=None, image=""))  # every action is a script sh reads too
    proc = subprocess.run([shell, "-n"], input=text, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    # the key never reaches a command line: read from the 0600 file, given to curl on stdin
    assert "Authorization: Bearer %s" in text and "-K -" in text
    # the replica as serving/replicas.py names it, its GPUs sorted as the check compares them
    assert ("REPLICAS='index=1 unit=podman-vllm-diffusiongemma-1.service container=vllm-diffusiongemma-1 "
            "port=8101 server=replica1 gpus=GPU-a,GPU-b'" in text)


def test_a_script_cut_short_on_its_way_runs_nothing():
    """A link lost while the script is sent leaves the host's sh with part of it: none of it runs
    (unwrapped, sh would run the drain, or the write, and stop there)."""
    text = script(_roll())
    begin = text.index("@begin")  # past it, an unwrapped script would start draining
    for cut in (begin + 20, (begin + len(text)) // 2, len(text) - 40):
        ran = subprocess.run(["sh", "-s"], input=text[:cut], capture_output=True, text=True, timeout=30)
        assert "@" not in ran.stdout and ran.returncode != 0, (cut, ran.stdout)


def _out(*lines, rc=0):
    return Result(rc, "\n".join(lines) + "\n", "")


def _result(outcome, ms, why="", units="", failed_ms="", again="", ready_ms=""):
    """roll.sh's last line."""
    return "@result " + json.dumps({"outcome": outcome, "ms": ms, "why": why, "units": units, "failed_ms": failed_ms,
                                    "again": again, "ready_ms": ready_ms})


def test_a_roll_that_passed_says_how_long_the_replica_was_out():
    said = interpret(_roll())(_out("@begin 1000", "@drained 400 0", "@gate-passed 1 the front door",
                                   "@in-service 1 8500", _result("done", 8500, ready_ms=5300))).message
    assert said == ("podman-vllm-diffusiongemma-1.service rolled: drained in 0.4 s; new unit, restarted, ready in "
                    "5.3 s; gate passed (the front door, its checks); out of service 7.5 s")
    alone = interpret(_roll(alone=True, unit_file=None))(
        _out("@begin 0", "@no-frontdoor", "@gate-passed 1 loopback", _result("done", 6000, ready_ms=5000))).message
    assert "nothing to drain; restarted" in alone and "served no request while it restarted" in alone


def test_a_replica_that_failed_its_gate_and_went_back_says_so_with_its_log():
    out = _out("@begin 0", "@drained 10 0", "  | ERROR EngineCore encountered an issue", "@retagged",
               "@gate-passed 1 the front door", "@in-service 1 16000",
               _result("rolled-back", 16000, "a chat completion through the front door answered 500", failed_ms=9000,
                       ready_ms=5000), rc=5)
    with pytest.raises(StepFailed) as failed:
        interpret(_roll())(out)
    message = str(failed.value)
    assert "failed its gate: a chat completion through the front door answered 500" in message
    assert "rolled back to what it ran before (its unit, and the image it ran, retagged)" in message
    assert "in service again 7.0 s after the failure" in message and "The rollout stops here" in message
    assert "  | ERROR EngineCore encountered an issue" in message


def test_a_rollback_that_failed_too_says_what_to_run():
    out = _out("@begin 0", "@no-frontdoor",
               _result("rollback-failed", 200, "its container exited after 5 s (activating/auto-restart)",
                       "podman-vllm-diffusiongemma-1.service", 100, "its container exited after 5 s (failed/failed)"),
               rc=6)
    with pytest.raises(StepFailed, match="(?s)going back to what it ran failed too .*invoke recover --hosts hgx01 "
                                         "--replica 1"):
        interpret(_roll())(out)


def test_the_start_role_does_not_wait_again_for_a_replica_its_roll_gated():
    """A roll restarts and gates a replica (its step satisfies the restart handler and produces
    `gated`): the start role's wait is for replicas that did not run, or a handler restarted."""
    from converge.changes import HostContext
    from serving.serving_host import restart
    from roles.start.role import plan as start_plan
    from serving.handoffs import gated
    from serving.handoffs import UNITS, UnitPlan, Units
    from serving.replicas import Served
    first = replica({}, 0)
    unit = first.unit
    running = {"ActiveState": "active", "SubState": "running", "LoadState": "loaded"}
    ctx = HostContext("rtx01", {"container_runtime": "podman"}, {"replica_units": {first.unit_path: {"state": running}}})
    ctx.results.record(UNITS, Units((UnitPlan(Served(first, "m", 0.7), "diffusiongemma", ("diffusiongemma",),
                                              first.unit_path, ""),), "unit", "img"), "service")
    ctx.handlers_run.add(restart(unit))
    assert next(start_plan(ctx)).needed()  # restarted by the handler: waited for
    ctx.results.record(gated(unit), unit, "service | rolling restart")
    assert not next(start_plan(ctx)).needed()  # gated by its roll: not waited for again


# systemctl as the host's would answer these programs: a unit active and running; `stop` exits $STOP_RC
SYSTEMCTL = """#!/bin/sh
echo "$*" >> "$CALLS"
case $1 in
  show) case "$*" in *--value*) echo 0 ;; *) echo ActiveState=active; echo SubState=running; echo NRestarts=0 ;; esac ;;
  stop) exit "${STOP_RC:-0}" ;;
esac
"""


def _run_on_stand_ins(text: str, tmp_path, **env) -> tuple[int, str, list[str]]:
    """A host program run for real under dash, systemctl and journalctl stand-ins (no front door:
    its admin socket is not there; no replica answers: nothing listens on its port)."""
    import os
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in {"systemctl": SYSTEMCTL, "journalctl": "#!/bin/sh\necho 'vLLM: it went away'\n"}.items():
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    (tmp_path / "key.env").write_text("VLLM_API_KEY=k\n")
    proc = subprocess.run(["dash", "-s"], input=text, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), **env})
    return proc.returncode, proc.stdout, calls.read_text().splitlines()


@pytest.mark.parametrize("stop_rc, outcome", [("0", "done"), ("1", "failed")])
def test_a_roll_run_for_real_ends_with_its_result_last(tmp_path, stop_rc, outcome):
    from roles.service.rollout import ROLL
    roll = _roll(action="stop", unit_file=None, image="", env_path=str(tmp_path / "key.env"))
    rc, out, calls = _run_on_stand_ins(script(roll), tmp_path, STOP_RC=stop_rc)
    said = ROLL.result_of(out)
    assert out.splitlines()[-1].startswith("@result ") and said["outcome"] == outcome, out
    assert "stop podman-vllm-diffusiongemma-1.service" in calls
    if outcome == "failed":
        assert rc == ROLL.exit("failed") and said["why"] == "systemctl stop failed" and "  | vLLM: it went away" in out
        with pytest.raises(StepFailed, match="(?s)stop of podman-vllm-diffusiongemma-1.service failed: systemctl "
                                             "stop failed.*invoke recover --hosts hgx01"):
            interpret(roll)(Result(rc, out, ""))
    else:
        assert rc == 0 and said["why"] == "" and "@no-frontdoor" in out
        assert "stopped" in str(interpret(roll)(Result(rc, out, "")))


def test_a_start_that_nobody_answers_times_out_naming_the_units_in_its_result(tmp_path):
    from serving.replicas import shell_table
    from roles.start.role import PROGRAM, START
    replicas = [replica({}, 1, gpus=()), replica({}, 2, gpus=())]
    rc, out, calls = _run_on_stand_ins(PROGRAM.script({"ENV_FILE": tmp_path / "key.env", "REPLICAS": shell_table(replicas),
                                                       "READY_TIMEOUT_S": 0}), tmp_path)
    said = START.result_of(out)
    assert rc == START.exit("timeout") and out.splitlines()[-1].startswith("@result "), out
    assert said["state"] == "timeout" and said["units"].split() == [r.unit for r in replicas]
    assert any(c.startswith("start") and replicas[1].unit in c for c in calls), calls
