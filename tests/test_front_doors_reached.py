"""The gateway's reach of the front doors (serving/haproxy/reach.py, files/front_doors_reached.sh):
the program on real sockets of this machine (a front door listening, and a port that refuses: a
new host whose front door is not up yet, reached all the same), what its output says, and the
refusal that names the hop. The lab's own test refuses spark01, which cannot reach h100-01 behind
its bastion (tests/lab/test_lab_small.py)."""
from __future__ import annotations

import socket
import subprocess

import pytest

from converge.errors import StepFailed
from converge.transport import Result
from serving.fleet import FrontDoor
from serving.haproxy.reach import REACH_PROGRAM, reach_step, unreachable


def test_a_listening_and_a_refusing_front_door_are_both_reached():
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections refused
        doors = (FrontDoor("up", "127.0.0.1", listening.getsockname()[1]),
                 FrontDoor("new", "127.0.0.1", closed.getsockname()[1]))
        step = reach_step("gw", doors)
        out = subprocess.run(["sh", "-c", step.script], capture_output=True, text=True, timeout=20)
    assert out.stdout.splitlines() == ["door up reached", "door new reached"], out
    assert step.interpret(Result(out.returncode, out.stdout, out.stderr)) == "reaches the front doors of up, new"
    assert step.script.count(REACH_PROGRAM.text()) == 1


def test_a_door_not_reached_fails_the_step_naming_the_hop_and_what_to_do():
    doors = (FrontDoor("spark01", "10.213.0.11", 8001), FrontDoor("h100-01", "10.213.1.13", 8000))
    step = reach_step("spark01", doors)
    output = "door spark01 reached\ndoor h100-01 unreachable no answer within 3 s\n"
    assert unreachable(output) == {"h100-01": "no answer within 3 s"}
    with pytest.raises(StepFailed) as failed:
        step.interpret(Result(0, output, ""))
    message = str(failed.value)
    assert message.startswith("spark01 -> h100-01 (10.213.1.13:8000): no answer within 3 s: ")
    assert "nothing was changed on spark01" in message and "take h100-01 out of the serving hosts" in message


def test_a_program_that_could_not_run_is_a_failure_of_its_own():
    step = reach_step("gw", (FrontDoor("a", "127.0.0.1", 1),))
    with pytest.raises(StepFailed, match="could not be asked on gw"):
        step.interpret(Result(127, "", "sh: bash: not found"))
