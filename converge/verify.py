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
from dataclasses import dataclass
from pathlib import Path

from testinfra.backend.base import BaseBackend, CommandResult

from .transport import Transport

COMMAND_TIMEOUT_S = 300
# what the checks of one run read: set by `run` before pytest starts (one run per process)
TRANSPORTS: dict[str, Transport] = {}
EXPECTED: dict = {}


@dataclass
class CheckResult:
    host: str
    check: str
    status: str  # passed, failed, skipped
    message: str = ""


class TransportBackend(BaseBackend):
    """testinfra's commands as scripts on the host's transport (``converge://NAME``)."""

    NAME = "converge"

    def run(self, command: str, *args: str, **kwargs) -> CommandResult:
        command = self.quote(command, *args)
        result = TRANSPORTS[self.hostname].run(command + "\n", timeout=COMMAND_TIMEOUT_S)
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
    with contextlib.redirect_stdout(output):
        pytest.main(args + ([f"--junitxml={junit}"] if junit else []), plugins=[outcomes])
    return outcomes.results, output.getvalue()
