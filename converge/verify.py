"""Run testinfra checks against hosts through the run's own transports.

pytest runs in this process, once per ``invoke verify``, with a testinfra backend
whose commands are our transport's scripts: verify reaches a host on the same
connection as the check run before it, through the same jump hosts, and becomes
(sudo, with its password on stdin) exactly as deploy does. Each check's outcome
is read as pytest reports it (a JUnit file is written only when asked for).
"""
from __future__ import annotations

import contextlib
import io
import re
import secrets
import shlex
from dataclasses import dataclass
from pathlib import Path

from testinfra.backend.base import BaseBackend, CommandResult

from .errors import RemoteCommandError
from .transport import Result, Transport

COMMAND_TIMEOUT_S = 300
# what the checks of one run read: set by `run` before pytest starts (one run per process)
TRANSPORTS: dict[str, Transport] = {}
EXPECTED: dict = {}
# each host's check shell, once it has been opened (a host whose shell broke runs without one)
SHELLS: dict[str, "CheckShell | None"] = {}


@dataclass
class CheckResult:
    host: str
    check: str
    status: str  # passed, failed, skipped
    message: str = ""


class CheckShell:
    """One shell per host that runs every check command of the run, each read from its
    stdin: a check costs its own command, not a new SSH channel and a sudo (over a slow
    link, or where sudo hashes a password, those were most of a check's time).

    Each command goes as its lines then the session's boundary line; it runs in a subshell
    (``eval``: on no command line, as ``sh -s`` read it before), its stdin /dev/null, its
    standard error in a file of a 0700 folder. Back come its output, the boundary line, its
    exit status, its standard error, the boundary's end line (both read as the held
    script's markers are, with their bound on the output)."""

    SCRIPT = Path(__file__).parent / "host_scripts" / "check_shell.sh"

    def __init__(self, transport: Transport):
        self.boundary = "@@check-" + secrets.token_hex(8)
        self.held = transport.hold(f"BOUNDARY={shlex.quote(self.boundary)}\n{self.SCRIPT.read_text()}",
                                   timeout=COMMAND_TIMEOUT_S)
        ready, complete = self.held.read_until(f"{self.boundary} ready", 60)
        if not complete:
            self.held.close()
            raise RemoteCommandError(f"the check shell did not start: {ready.strip()[-300:]}")

    def run(self, command: str) -> Result:
        self.held.proc.write(f"{command}\n{self.boundary}\n".encode())
        stdout = self._until(f"{self.boundary} out", COMMAND_TIMEOUT_S)
        rc = self.held.readline(60)
        if rc is None or not rc.isdigit():
            raise RemoteCommandError(f"{self.held.name}: the check shell ended: {rc!r}")
        return Result(int(rc), stdout, self._until(f"{self.boundary} end", 60))

    def _until(self, marker: str, timeout: float) -> str:
        """The lines up to ``marker`` (the newline the shell put before it is not the command's)."""
        text, complete = self.held.read_until(marker, timeout)
        if not complete:
            raise RemoteCommandError(f"{self.held.name}: the check shell ended: {text[-300:]}")
        return text

    def close(self):
        self.held.close()


def run_check_command(host: str, command: str) -> Result:
    """``command`` on ``host``: through its check shell (opened at the first), or on a
    channel of its own where no shell could be opened. A shell that fails a command is
    closed: the next command opens another."""
    transport = TRANSPORTS[host]
    if host not in SHELLS:
        try:
            SHELLS[host] = CheckShell(transport)
        except RemoteCommandError:
            SHELLS[host] = None  # e.g. no temporary folder: each check on its own channel, as before
    shell = SHELLS[host]
    if shell is None:
        return transport.run(command + "\n", timeout=COMMAND_TIMEOUT_S)
    try:
        return shell.run(command)
    except Exception:
        SHELLS.pop(host, None)
        shell.close()
        raise


def close_shells():
    for shell in SHELLS.values():
        if shell is not None:
            shell.close()
    SHELLS.clear()


class TransportBackend(BaseBackend):
    """testinfra's commands as scripts on the host's transport (``converge://NAME``)."""

    NAME = "converge"

    def run(self, command: str, *args: str, **kwargs) -> CommandResult:
        command = self.quote(command, *args)
        result = run_check_command(self.hostname, command)
        return self.result(result.rc, self.encode(command), result.stdout.encode(), result.stderr.encode())

    def get_encoding(self) -> str:
        return "utf-8"  # what the transport decoded with; testinfra would ask the host's python


class _Outcomes:
    """A pytest plugin that keeps each check's outcome."""

    def __init__(self):
        self.results: list[CheckResult] = []

    def pytest_runtest_logreport(self, report):
        if report.when == "call" or (report.when == "setup" and not report.passed):
            self.results.append(outcome(report.nodeid, report.outcome, report.longrepr))


def outcome(nodeid: str, status: str, longrepr) -> CheckResult:
    """``roles/service/tests/test_service.py::test_unit_file[converge://rtx01]`` as a row."""
    path, _, name = nodeid.partition("::")
    match = re.match(r"(?P<check>[^\[]+)\[(?:[a-z-]+://)?(?P<host>[^\]-][^\]]*?)\]$", name)
    check = (match.group("check") if match else name).removeprefix("test_")
    parts = Path(path).parts
    if len(parts) > 2 and parts[0] == "roles":
        check = f"{parts[1]}: {check}"
    message = ""
    if status == "skipped" and isinstance(longrepr, tuple):
        message = str(longrepr[2]).removeprefix("Skipped: ")
    elif status == "failed":
        crash = getattr(longrepr, "reprcrash", None)
        message = _why(crash.message if crash is not None else str(longrepr))
    return CheckResult(match.group("host") if match else "?", check, status, message)


def _why(text: str) -> str:
    """The assertion's own message, without pytest's expression dump."""
    text = re.sub(r"^AssertionError: ", "", text.strip())
    return text.split("\nassert ")[0].split("\n+  where")[0].strip()[:600]


def run(transports: dict[str, Transport], test_paths: list[str], expected: dict,
        junit: str | None = None) -> tuple[list[CheckResult], str]:
    """Run the checks on every host of ``transports``; returns the results and pytest's output."""
    import pytest
    import testinfra.backend
    testinfra.backend.BACKENDS[TransportBackend.NAME] = f"{__name__}.TransportBackend"
    TRANSPORTS.clear()
    TRANSPORTS.update(transports)
    EXPECTED.clear()
    EXPECTED.update(expected)
    outcomes = _Outcomes()
    args = [*test_paths, "--hosts=" + ",".join(f"converge://{name}" for name in transports), "-p",
            "no:cacheprovider", "-q", "-rN", "--tb=line", "-o", "junit_family=xunit1"]
    output = io.StringIO()
    try:
        with contextlib.redirect_stdout(output):
            pytest.main(args + ([f"--junitxml={junit}"] if junit else []), plugins=[outcomes])
    finally:
        close_shells()
    return outcomes.results, output.getvalue()
