"""Run testinfra checks against hosts over SSH, in one pytest subprocess, and
read its JUnit XML back into a host x check table.

One subprocess per run: pytest caches imports between runs in one process. The
SSH settings come from the inventory (resolved through ssh_config as Fabric
does), written into an ssh_config for OpenSSH with host-key checking on
(StrictHostKeyChecking yes, the inventory's known_hosts) and the same jump
hosts (ProxyJump). Become goes through converge.testinfra_become.
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

from . import fabric_ssh, ssh_config as ssh_config_files
from .ssh_settings import SSHSettings
from .testinfra_become import FD_VARIABLE, encode


@dataclass
class CheckResult:
    host: str
    check: str
    status: str  # passed, failed, skipped
    message: str = ""


def _block(alias: str, conn, s: SSHSettings, keys: list[str], jump: str | None) -> str:
    lines = [f"Host {alias}", f"  HostName {conn.host}", f"  Port {conn.port}", f"  User {conn.user}",
             "  StrictHostKeyChecking yes", "  BatchMode yes", f"  ConnectTimeout {int(s.connect_timeout)}",
             "  ControlMaster auto", "  ControlPath /tmp/converge-verify-%C", "  ControlPersist 30"]
    if jump:
        lines.append(f"  ProxyJump {jump}")
    if keys:
        lines += [f"  IdentityFile {k}" for k in keys] + ["  IdentitiesOnly yes"]
    if s.known_hosts:
        lines.append(f"  UserKnownHostsFile {s.known_hosts}")
    return "\n".join(lines)


def ssh_config(settings: list[SSHSettings]) -> str:
    """An ssh_config for OpenSSH saying what our engine does for each host: the
    address, user and port Fabric resolved, the key, known_hosts, and jump hosts
    (one ``Host`` block per hop, so that their keys are checked too). Nothing else
    is read (ssh -F)."""
    blocks = []
    hops_seen: dict[tuple, str] = {}
    for s in settings:
        chain = []
        for hop in s.jumps:
            conn = fabric_ssh.for_hop(hop, s)
            key = (conn.host, conn.port, conn.user, s.key_file, s.known_hosts, tuple(chain))
            if key not in hops_seen:
                hops_seen[key] = f"converge-jump-{len(hops_seen)}"
                hop_keys = ssh_config_files.lookup(hop.host).get("identityfile", []) + \
                    ([s.key_file] if s.key_file else [])
                blocks.append(_block(hops_seen[key], conn, s, [os.path.expanduser(k) for k in hop_keys],
                                     ",".join(chain) or None))
            chain.append(hops_seen[key])
        conn = fabric_ssh.for_host(s)
        keys = [s.key_file] if s.key_file else [os.path.expanduser(k) for k in conn.ssh_config.get("identityfile", [])]
        blocks.append(_block(s.name, conn, s, keys, ",".join(chain) or None))
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
        hosts = ",".join(f"converge-ssh://{s.name}" for s in settings)
        # become passwords reach the checks through a pipe, never argv or the environment
        read_end, write_end = os.pipe()
        env = dict(os.environ, CONVERGE_EXPECTED=str(expected_file), **{FD_VARIABLE: str(read_end)})
        args = [sys.executable, "-m", "pytest", "-p", "converge.testinfra_become", *test_paths, f"--hosts={hosts}",
                f"--ssh-config={config}", f"--junitxml={xml}", "-p", "no:cacheprovider", "-q", "-rN", "--tb=line",
                "-o", "junit_family=xunit1"]
        try:
            proc = subprocess.Popen(args, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    text=True, pass_fds=(read_end,))
        finally:
            os.close(read_end)
        with os.fdopen(write_end, "wb") as pipe:
            pipe.write(encode({s.name: s.become for s in settings if s.become}))
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        proc = subprocess.CompletedProcess(args, proc.returncode, stdout, stderr)
        results = parse_junit(Path(xml).read_text()) if Path(xml).exists() else []
        return results, proc.stdout + proc.stderr


def parse_junit(text: str) -> list[CheckResult]:
    results = []
    for case in ET.fromstring(text).iter("testcase"):
        name = case.get("name", "")
        match = re.match(r"(?P<check>[^\[]+)\[(?:[a-z-]+://)?(?P<host>[^\]-][^\]]*?)\]$", name)
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
