"""A replica's roll script run for real by dash, the commands it calls (systemctl,
curl, podman, ss, journalctl) stood in for by small scripts that answer as a host
does: a roll that passes, and one whose first completion gets a 500 and goes back.
The lab runs it on real hosts (tests/lab/test_lab_rollout.py)."""
import os
import shutil
import socket
import subprocess

import pytest

from converge.changes import File
from converge.errors import StepFailed
from converge.transport import Result
from serving.haproxy.admin import ADMIN_SOCKET
from serving.replicas import replica
from roles.service import rollout

# replica 1 of a host whose service is vllm-x: unit podman-vllm-x-1.service, container vllm-x-1
R1 = replica({"service_name": "vllm-x"}, 1, gpus=("GPU-b", "GPU-a"))
U = R1.unit

STUBS = {
    "systemctl": """case "$*" in
  show*--value*) case "$*" in *NRestarts*) echo 0;; *ActiveState*) echo active;; *SubState*) echo running;; esac;;
  show*) printf 'NRestarts=0\nActiveState=active\nSubState=running\n';;
  restart*|start*) echo "$*" >> "$LOG"; echo UP > "$LOG.state";;
  stop*|"disable --now"*) echo "$*" >> "$LOG"; echo DOWN > "$LOG.state";;
  disable*) echo "$*" >> "$LOG";;
  kill*) echo "$*" >> "$LOG";; *) ;;
esac""",
    # the front door's stats page (admin actions, CSV) and the replica: a chat completion
    # answers 500 the first FAIL_FIRST times
    "curl": """all="$*"; out=""
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
case "$all" in
  *--data\\ s=*) echo "$all" | sed -n 's/.*s=\\([a-z0-9]*\\)&.*action=\\([a-z]*\\).*/admin \\1 \\2/p' >> "$LOG"
    # the front door refuses to put a replica back (HAProxy's stats page: st=DENY) when REFUSE_READY is set
    case "$all" in *action=ready*s=replica*|*s=replica*action=ready*) [ -n "$REFUSE_READY" ] && { echo 'location: /;st=DENY'; exit 0; };; esac
    echo 'location: /;st=DONE';;
  *";csv"*) printf '# pxname,svname,qcur,qmax,scur,slim,smax,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status\\n'
           printf 'servers,replica1,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,%s\\n' "$(cat "$LOG.state" 2>/dev/null || echo DRAIN)";;
  *chat/completions*) cat > /dev/null; n=$(cat "$LOG.chats" 2>/dev/null || echo 0); echo $((n + 1)) > "$LOG.chats"
     if [ "$n" -lt "$FAIL_FIRST" ]; then echo '{"error": "EngineCore encountered an issue"}' > "$out"; printf 500
     else echo '{"choices": [{"message": {"content": "OK"}}]}' > "$out"; printf 200; fi;;
  *) cat > /dev/null 2>&1;;
esac""",
    "podman": """case "$*" in
  exec*) printf 'GPU 0: NVIDIA H200 (UUID: GPU-a)\\nGPU 1: NVIDIA H200 (UUID: GPU-b)\\n';;
  tag*) echo "$*" >> "$LOG";;
  "image inspect"*) echo new-image;;
  rm*) echo "podman rm" >> "$LOG"; touch "$LOG.removed";;
  *) [ -e "$LOG.removed" ] && exit 1; echo old-image;;
esac""",
    "ss": "true", "journalctl": "echo 'ERROR EngineCore failed'",
}


@pytest.fixture
def host(tmp_path):
    """A folder of stand-in commands, a unit and an environment file, the front door's socket."""
    if not shutil.which("dash"):
        pytest.skip("dash is not installed")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in STUBS.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    (tmp_path / "unit.service").write_text("old unit\n")
    (tmp_path / "env").write_text("VLLM_API_KEY=k\n")
    admin = socket.socket(socket.AF_UNIX)
    admin.bind(str(tmp_path / "admin.sock"))
    yield tmp_path
    admin.close()


def _roll(host, fail_first: int, action="restart", write=True, replicas=(R1,), refuse_ready=False, lock_wait_s=120,
          **change):
    unit = File("unit file", path=str(host / "unit.service"), content="new unit\n", current=None,
                owner=str(os.getuid()), group=str(os.getgid()))
    deploy = dict(unit_file=unit, unit_path=unit.path, image="img:tag", same_image_ref=True) if write else {}
    paths = {"remove_paths": (str(host / "unit.service"),) if action == "remove" else ()}
    roll = rollout.Roll(host="hgx01", runtime="podman", action=action, replicas=replicas,
                        env_path=str(host / "env"), api_port=8000,
                        frontdoor_address="127.0.0.1", drain_timeout=5, ready_timeout=5, alone=False,
                        **{**paths, **deploy, **change})
    text = rollout.script(roll).replace(ADMIN_SOCKET, str(host / "admin.sock")) \
        .replace(rollout.ROLL_LOCK, str(host / "roll.lock")) \
        .replace(f"ROLL_LOCK_WAIT_S={roll.lock_wait_s}\n", f"ROLL_LOCK_WAIT_S={lock_wait_s}\n")
    env = {"PATH": f"{host / 'bin'}:/usr/bin:/bin", "LOG": str(host / "log"), "FAIL_FIRST": str(fail_first),
           "REFUSE_READY": "1" if refuse_ready else ""}
    proc = subprocess.run(["dash", "-s"], input=text, capture_output=True, text=True, env=env, timeout=60)
    log = (host / "log").read_text().splitlines() if (host / "log").exists() else []
    return roll, Result(proc.returncode, proc.stdout, proc.stderr), log


DRAIN = ["admin flag ready", "admin replica1 drain"]
BACK = ["admin replica1 ready", "admin flag maint"]


def test_a_roll_that_passes_drains_writes_restarts_gates_and_puts_back(host):
    roll, result, log = _roll(host, fail_first=0)
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"restart {U}", "admin replica1 hrunn"] + BACK
    assert (host / "unit.service").read_text() == "new unit\n"
    assert (host / "unit.service.previous").read_text() == "old unit\n"
    assert rollout.interpret(roll)(result).message.startswith(f"{U} rolled: drained in")


def _another_roll(host, seconds: float) -> subprocess.Popen:
    """A roll of the same host under way for ``seconds``: the host's roll lock held (flock(1), as
    roll.sh holds it), the way a roll whose run lost its link holds it while it runs on."""
    proc = subprocess.Popen(["flock", str(host / "roll.lock"), "sh", "-c", f"echo held; sleep {seconds}"],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_roll_waits_for_another_roll_of_its_host_to_end_then_rolls(host):
    other = _another_roll(host, 1.5)
    roll, result, log = _roll(host, fail_first=0)
    assert other.wait(5) == 0
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"restart {U}", "admin replica1 hrunn"] + BACK
    waited = int(result.stdout.split("@waited ", 1)[1].split()[0])
    assert 1000 <= waited < 5000, result.stdout
    assert rollout.interpret(roll)(result).message.startswith(f"{U} rolled: waited 1.")


def test_a_roll_that_another_roll_outlasts_fails_having_changed_nothing(host):
    other = _another_roll(host, 4)
    roll, result, log = _roll(host, fail_first=0, lock_wait_s=1)
    other.kill()
    assert result.rc == 4 and log == [], result.stdout + result.stderr  # no drain, no flag, no restart
    assert (host / "unit.service").read_text() == "old unit\n" and not (host / "unit.service.previous").exists()
    with pytest.raises(StepFailed, match=r"did not begin, and nothing was changed: another roll of this host.s "
                                         r"replicas was still under way after 1 s .*invoke logs --hosts hgx01.*Run this again"):
        rollout.interpret(roll)(result)


def test_a_roll_that_fails_its_gate_goes_back_to_its_unit_and_image_and_is_put_back(host):
    roll, result, log = _roll(host, fail_first=1)
    assert result.rc == 5, result.stdout + result.stderr
    # back to the unit it ran, the image it ran named by the tag again, restarted, gated, put back
    assert log == DRAIN + [f"restart {U}", "admin replica1 hrunn", "tag old-image img:tag", f"restart {U}",
                           "admin replica1 hrunn"] + BACK
    assert (host / "unit.service").read_text() == "old unit\n"
    with pytest.raises(StepFailed, match=r"(?s)answered 500.*its unit, and the image it ran, retagged.*"
                                         r"in service again .*ERROR EngineCore failed"):
        rollout.interpret(roll)(result)


def test_a_roll_whose_way_back_fails_too_still_leaves_it_in_service(host):
    roll, result, log = _roll(host, fail_first=99)
    assert result.rc == 6
    assert log[-2:] == BACK  # never left drained
    with pytest.raises(StepFailed, match="going back to what it ran failed too"):
        rollout.interpret(roll)(result)


def test_day_2_restart_has_nothing_to_go_back_to_and_says_what_to_run(host):
    roll, result, log = _roll(host, fail_first=0, write=False)
    assert result.rc == 0 and log == DRAIN + [f"restart {U}", "admin replica1 hrunn"] + BACK
    assert (host / "unit.service").read_text() == "old unit\n"
    roll, result, log = _roll(host, fail_first=99, write=False)
    assert result.rc == 4 and log[-2:] == BACK and "tag" not in " ".join(log)
    with pytest.raises(StepFailed, match=r"(?s)did not come back after its restart: replica 1: a chat completion.*"
                                         r"answered 500.*invoke recover --hosts hgx01 --replica 1"):
        rollout.interpret(roll)(result)


def test_a_stop_drains_stops_and_puts_it_back_once_its_front_door_sees_it_down(host):
    roll, result, log = _roll(host, fail_first=0, action="stop", write=False)
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"stop {U}"] + BACK  # no gate: nothing comes back
    said = rollout.interpret(roll)(result)
    assert said.startswith(f"{U} stopped: drained in") and "out of service" in said


def test_a_start_is_gated_through_the_front_door(host):
    roll, result, log = _roll(host, fail_first=0, action="start", write=False)
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"start {U}", "admin replica1 hrunn"] + BACK
    said = rollout.interpret(roll)(result)
    assert said.value == U and "gate passed (1 the front door, its checks)" not in said.message
    assert "started, ready in" in said.message and "gate passed (the front door" in said.message


def test_recover_clears_the_unit_and_container_then_starts_and_gates(host):
    roll, result, log = _roll(host, fail_first=0, action="recover", write=False)
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"stop {U}", f"kill -s KILL {U}", "podman rm", f"start {U}",
                           "admin replica1 hrunn"] + BACK
    said = rollout.interpret(roll)(result).message
    assert "replica 1: unit stopped and reset" in said and "container removed" in said and "gate passed" in said


def test_a_replica_no_longer_planned_is_drained_then_removed(host):
    roll, result, log = _roll(host, fail_first=0, action="remove", write=False)
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"disable --now {U}"] + BACK
    assert not (host / "unit.service").exists()


def test_a_replica_its_front_door_will_not_put_back_fails_the_roll_and_names_the_mend(host):
    roll, result, log = _roll(host, fail_first=0, refuse_ready=True)
    assert result.rc == 0 and "@undrain-failed 1 replica1" in result.stdout, result.stdout
    assert log == DRAIN + [f"restart {U}", "admin replica1 hrunn", "admin replica1 ready", "admin flag maint"]
    with pytest.raises(StepFailed, match=r"refused to put replica 1 \(replica1\) back in service after its restart: "
                                         r"it stays drained.*invoke recover --hosts hgx01 --replica 1"):
        rollout.interpret(roll)(result)


def test_a_replica_moves_to_its_familys_name_through_the_roll(host):
    """The unit it ran under stops, the new one starts and passes the gate, then the old unit's
    files go; the front door's server (the index's) is the same throughout."""
    before = replica({"service_name": "vllm-x"}, 1, "diffusiongemma")
    moved = replica({"service_name": "vllm-x"}, 1, "gemma4", gpus=R1.gpus)
    (host / "old.service").write_text("old unit\n")
    roll, result, log = _roll(host, fail_first=0, replicas=(moved,), replaces=before,
                              remove_paths=(str(host / "old.service"),))
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"stop {before.unit}", f"restart {moved.unit}", "admin replica1 hrunn",
                           f"disable {before.unit}"] + BACK
    assert not (host / "old.service").exists() and (host / "unit.service").read_text() == "new unit\n"
    said = rollout.interpret(roll)(result).message
    assert said.startswith(f"{moved.unit} rolled: drained in") and f"it ran as {before.unit} before" in said


def test_a_move_that_fails_its_gate_goes_back_to_the_unit_it_ran_under(host):
    before = replica({"service_name": "vllm-x"}, 1, "diffusiongemma")
    moved = replica({"service_name": "vllm-x"}, 1, "gemma4", gpus=R1.gpus)
    (host / "unit.service").unlink()  # the new unit did not exist before the move
    (host / "old.service").write_text("old unit\n")
    roll, result, log = _roll(host, fail_first=1, replicas=(moved,), replaces=before,
                              remove_paths=(str(host / "old.service"),))
    assert result.rc == 5, result.stdout + result.stderr
    assert log[:4] == DRAIN + [f"stop {before.unit}", f"restart {moved.unit}"]
    assert f"restart {before.unit}" in log and log[-2:] == BACK
    assert not (host / "unit.service").exists() and (host / "old.service").read_text() == "old unit\n"


def test_a_trial_passes_its_gate_and_stays_out_of_service_with_its_flag_up(host):
    """invoke tune's trial (hold): drained, the new unit, restarted, gated through the front door,
    and then neither put back nor its flag lowered: no user's request reaches it."""
    roll, result, log = _roll(host, fail_first=0, hold=True)
    assert result.rc == 0, result.stdout + result.stderr
    assert log == DRAIN + [f"restart {U}", "admin replica1 hrunn"]  # no "ready", no "flag maint"
    assert "@held 1" in result.stdout
    assert "held out of service (a trial" in rollout.interpret(roll)(result).message


def test_a_trial_that_fails_its_gate_goes_back_and_is_put_back_in_service(host):
    roll, result, log = _roll(host, fail_first=1, hold=True)
    assert result.rc == 5, result.stdout + result.stderr
    assert log[-2:] == BACK and (host / "unit.service").read_text() == "old unit\n"


def test_a_trial_with_no_front_door_to_hold_its_replica_changes_nothing(host):
    (host / "admin.sock").unlink()
    roll, result, log = _roll(host, fail_first=0, hold=True)
    assert result.rc == 4 and log == [], result.stdout + result.stderr
    assert (host / "unit.service").read_text() == "old unit\n"
    with pytest.raises(StepFailed, match="no front door holds replica 1 out of service, and a trial needs one"):
        rollout.interpret(roll)(result)
