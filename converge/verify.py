"""Run testinfra checks against hosts over SSH, in one pytest subprocess, and
read its JUnit XML back into a host x check table.

One subprocess per run: pytest caches imports between runs in one process. The
SSH settings come from the inventory, written into an ssh_config with host-key
checking on (StrictHostKeyChecking yes, the inventory's known_hosts).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

from .connection import SSHSettings


@dataclass
class CheckResult:
    host: str
    check: str
    status: str  # passed, failed, skipped
    message: str = ""


def ssh_config(settings: list[SSHSettings]) -> str:
    blocks = []
    for s in settings:
        lines = [f"Host {s.name}", f"  HostName {s.address}", f"  Port {s.port}", f"  User {s.user}",
                 "  StrictHostKeyChecking yes", "  BatchMode yes", f"  ConnectTimeout {int(s.connect_timeout)}",
                 "  ControlMaster auto", "  ControlPath /tmp/converge-verify-%C", "  ControlPersist 30"]
        if s.key_file:
            lines += [f"  IdentityFile {s.key_file}", "  IdentitiesOnly yes"]
        if s.known_hosts:
            lines.append(f"  UserKnownHostsFile {s.known_hosts}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks) + "\n"


def run(settings: list[SSHSettings], test_paths: list[str], expected: dict, junit: str | None = None,
        cwd: str | None = None, timeout: float = 1800) -> tuple[list[CheckResult], str]:
    """Run the checks; returns the results and pytest's output."""
    with tempfile.TemporaryDirectory(prefix="converge-verify-") as tmp:
        config = Path(tmp) / "ssh_config"
        config.write_text(ssh_config(settings))
        expected_file = Path(tmp) / "expected.json"
        expected_file.write_text(json.dumps(expected))
        xml = junit or str(Path(tmp) / "junit.xml")
        hosts = ",".join(f"ssh://{s.name}" for s in settings)
        env = dict(os.environ, CONVERGE_EXPECTED=str(expected_file))
        args = [sys.executable, "-m", "pytest", *test_paths, f"--hosts={hosts}", f"--ssh-config={config}",
                f"--junitxml={xml}", "-p", "no:cacheprovider", "-q", "-rN", "--tb=line", "-o", "junit_family=xunit1"]
        proc = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        results = parse_junit(Path(xml).read_text()) if Path(xml).exists() else []
        return results, proc.stdout + proc.stderr


def parse_junit(text: str) -> list[CheckResult]:
    results = []
    for case in ET.fromstring(text).iter("testcase"):
        name = case.get("name", "")
        match = re.match(r"(?P<check>[^\[]+)\[(?:ssh://)?(?P<host>[^\]-][^\]]*?)\]$", name)
        host = match.group("host") if match else "?"
        check = (match.group("check") if match else name).removeprefix("test_")
        role = case.get("classname", "").split(".")[1] if case.get("classname", "").startswith("roles.") else ""
        check = f"{role}: {check}" if role else check
        status, message = "passed", ""
        for tag in ("failure", "error"):
            node = case.find(tag)
            if node is not None:
                status = "failed"
                message = _why(node.get("message") or node.text or "")
        node = case.find("skipped")
        if node is not None:
            status, message = "skipped", (node.get("message") or "").removeprefix("Skipped: ")
        results.append(CheckResult(host, check, status, message))
    return results


def _why(text: str) -> str:
    """The assertion's own message, without pytest's expression dump."""
    text = text.strip()
    text = re.sub(r"^AssertionError: ", "", text)
    first = text.split("\nassert ")[0].split("\n+  where")[0]
    return first.strip()[:600]
