"""verify's check shell (converge.verify.CheckShell) on this machine: every check
command of a host through one shell, each with its own output, standard error and
exit status, as a command on a channel of its own gives them."""
import pytest

from converge import verify
from converge.errors import RemoteCommandError
from converge.transport.local import LocalTransport

COMMANDS = [
    "echo one; echo two",
    "printf 'no newline at the end'",
    "printf ''",
    "echo out; echo err >&2; exit 3",
    "printf 'err without newline' >&2",
    "x=$(printf 'a\\nb'); printf '%s\\n' \"$x\" | wc -l",
    "cat <<'EOF'\n  indented \\ backslash $HOME\n\nEOF",
    "echo \"[$1] [$#]\"",  # no arguments, whatever the shell itself was given
    "read line; echo \"read: [$line] $?\"",  # stdin is /dev/null, not the next command
    "cd /; exit 0",
    "pwd",  # the cd above stayed in its own subshell
    "exec sh -c 'echo exec; exit 7'",
    "set -e; false; echo not reached",
    "printf '@@check-0000 out\\n0\\n'",  # lines like the markers are output like any other
]


@pytest.fixture
def host():
    transport = LocalTransport("here")
    verify.TRANSPORTS.clear()
    verify.TRANSPORTS["here"] = transport
    yield "here"
    verify.close_shells()
    verify.TRANSPORTS.clear()
    transport.close()


def test_each_command_reads_back_as_it_does_on_a_channel_of_its_own(host):
    transport = verify.TRANSPORTS[host]
    through_shell = [verify.run_check_command(host, command) for command in COMMANDS]
    assert isinstance(verify.SHELLS[host], verify.CheckShell)  # one shell ran them all
    alone = [transport.run(command + "\n") for command in COMMANDS]
    for command, mine, theirs in zip(COMMANDS, through_shell, alone):
        if command.startswith("pwd"):
            continue  # `sh -s` starts where this process runs, the shell where it was started: the same here
        assert (mine.rc, mine.stdout, mine.stderr) == (theirs.rc, theirs.stdout, theirs.stderr), command
    assert through_shell[3].rc == 3 and through_shell[3].stderr == "err\n"
    assert through_shell[7].stdout == "[] [0]\n"
    assert through_shell[8].stdout.startswith("read: [] 1")


def test_a_shell_that_broke_is_replaced_at_the_next_command(host):
    assert verify.run_check_command(host, "echo first").stdout == "first\n"
    first = verify.SHELLS[host]
    first.held.proc.kill()
    with pytest.raises(RemoteCommandError):
        verify.run_check_command(host, "echo lost")
    assert host not in verify.SHELLS
    assert verify.run_check_command(host, "echo again").stdout == "again\n"
    assert verify.SHELLS[host] is not first


def test_without_a_temporary_folder_each_command_runs_on_its_own_channel(host, monkeypatch):
    monkeypatch.setenv("TMPDIR", "/nonexistent/folder")
    result = verify.run_check_command(host, "echo still; exit 4")
    assert verify.SHELLS[host] is None
    assert (result.rc, result.stdout) == (4, "still\n")
