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
from roles.service import rollout

STUBS = {
    "systemctl": """case "$*" in
  *NRestarts*) echo 0;; *ActiveState*) echo active;; *SubState*) echo running;;
  restart*) echo "$*" >> "$LOG";; *) ;;
esac""",
    # the front door's stats page (admin actions, CSV) and the replica: a chat completion
    # answers 500 the first FAIL_FIRST times
    "curl": """all="$*"; out=""
while [ $# -gt 0 ]; do [ "$1" = "-o" ] && out="$2"; shift; done
case "$all" in
  *--data\\ s=*) echo "$all" | sed -n 's/.*action=\\([a-z]*\\).*/admin \\1/p' >> "$LOG"; echo 'location: /;st=DONE';;
  *";csv"*) printf '# pxname,svname,qcur,qmax,scur,slim,smax,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status\\n'
           printf 'servers,replica1,0,0,0,0,0,0,0,0,0,0,0,0,0,0,0,DRAIN\\n';;
  *chat/completions*) cat > /dev/null; n=$(cat "$LOG.chats" 2>/dev/null || echo 0); echo $((n + 1)) > "$LOG.chats"
     if [ "$n" -lt "$FAIL_FIRST" ]; then echo '{"error": "EngineCore encountered an issue"}' > "$out"; printf 500
     else echo '{"choices": [{"message": {"content": "OK"}}]}' > "$out"; printf 200; fi;;
  *) cat > /dev/null 2>&1;;
esac""",
    "podman": """case "$*" in
  exec*) printf 'GPU 0: NVIDIA H200 (UUID: GPU-a)\\nGPU 1: NVIDIA H200 (UUID: GPU-b)\\n';;
  tag*) echo "$*" >> "$LOG";;
  "image inspect"*) echo new-image;; *) echo old-image;;
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


def _roll(host, fail_first: int):
    unit = File("unit file", path=str(host / "unit.service"), content="new unit\n", current=None,
                owner=str(os.getuid()), group=str(os.getgid()))
    roll = rollout.Roll(host="hgx01", runtime="podman", index=1, unit="u.service", unit_path=unit.path,
                        container="c", port=8101, gpus=("GPU-b", "GPU-a"), env_path=str(host / "env"),
                        unit_file=unit, image="img:tag", same_image_ref=True, served_model_name="m", api_port=8000,
                        frontdoor_address="127.0.0.1", drain_timeout=5, ready_timeout=5, alone=False)
    text = rollout.script(roll).replace(rollout.ADMIN_SOCKET, str(host / "admin.sock"))
    env = {"PATH": f"{host / 'bin'}:/usr/bin:/bin", "LOG": str(host / "log"), "FAIL_FIRST": str(fail_first)}
    proc = subprocess.run(["dash", "-s"], input=text, capture_output=True, text=True, env=env, timeout=60)
    log = (host / "log").read_text().splitlines()
    return roll, Result(proc.returncode, proc.stdout, proc.stderr), log


def test_a_roll_that_passes_drains_writes_restarts_gates_and_puts_back(host):
    roll, result, log = _roll(host, fail_first=0)
    assert result.rc == 0, result.stdout + result.stderr
    assert log == ["admin drain", "restart u.service", "admin hrunn", "admin ready"]
    assert (host / "unit.service").read_text() == "new unit\n"
    assert (host / "unit.service.previous").read_text() == "old unit\n"
    assert rollout.interpret(roll)(result).startswith("u.service rolled: drained in")


def test_a_roll_that_fails_its_gate_goes_back_to_its_unit_and_image_and_is_put_back(host):
    roll, result, log = _roll(host, fail_first=1)
    assert result.rc == 5, result.stdout + result.stderr
    # back to the unit it ran, the image it ran named by the tag again, restarted, gated, put back
    assert log == ["admin drain", "restart u.service", "admin hrunn", "tag old-image img:tag", "restart u.service",
                   "admin hrunn", "admin ready"]
    assert (host / "unit.service").read_text() == "old unit\n"
    with pytest.raises(StepFailed, match=r"(?s)answered 500.*its unit, and the image it ran, retagged.*"
                                         r"in service again .*ERROR EngineCore failed"):
        rollout.interpret(roll)(result)


def test_a_roll_whose_way_back_fails_too_still_leaves_it_in_service(host):
    roll, result, log = _roll(host, fail_first=99)
    assert result.rc == 6
    assert log[-1] == "admin ready"  # never left drained
    with pytest.raises(StepFailed, match="going back to what it ran failed too"):
        rollout.interpret(roll)(result)
