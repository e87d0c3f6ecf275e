"""A testinfra backend for ``invoke verify``: OpenSSH (testinfra's ssh backend,
with the ssh_config verify writes: host keys, jump hosts), and become as the
deploy does it.

testinfra's own sudo (``sudo /bin/sh -c CMD``) cannot answer a password prompt.
Here each command runs under ``converge.become`` (``sudo -n``, or ``sudo -S``
with the password first on the ssh process's stdin). The passwords come from
the parent ``invoke verify`` through an inherited pipe (``CONVERGE_BECOME_FD``
names its descriptor), never through argv or the environment.

Loaded as a pytest plugin (``-p converge.testinfra_become``); hosts are given as
``converge-ssh://NAME``.
"""
from __future__ import annotations

import json
import os
import subprocess

import testinfra.backend
from testinfra.backend import base
from testinfra.backend.ssh import SshBackend

from .become import Become

FD_VARIABLE = "CONVERGE_BECOME_FD"
_BECOME: dict[str, Become] = {}


def _load():
    """Read every host's become settings once, from the inherited pipe."""
    fd = os.environ.get(FD_VARIABLE)
    if not fd or _BECOME:
        return
    with os.fdopen(int(fd), "r", encoding="utf-8") as pipe:
        data = json.load(pipe)
    for host, entry in data.items():
        _BECOME[host] = Become(user=entry["user"], method=entry["method"], password=entry["password"])


def encode(become: dict[str, Become]) -> bytes:
    """What verify writes into the pipe."""
    return json.dumps({h: {"user": b.user, "method": b.method, "password": b.password}
                       for h, b in become.items()}).encode()


class BecomeSshBackend(SshBackend):
    NAME = "converge-ssh"

    def run(self, command: str, *args: str, **kwargs) -> base.CommandResult:
        command = self.quote(command, *args)
        become = _BECOME.get(self.host.name)
        if become is None:
            return self.run_ssh(command)
        remote = become.command()  # sh -s under sudo, reading the script on stdin
        cmd, cmd_args = self._build_ssh_command(remote)
        line = self.quote(" ".join(cmd), *cmd_args)
        proc = subprocess.run(line, shell=True, input=become.preamble() + command.encode() + b"\n",
                              capture_output=True)
        result = self.result(proc.returncode, self.encode(command), proc.stdout, proc.stderr)
        if proc.returncode == 255:
            raise RuntimeError(result)
        return result


def pytest_configure(config):
    _load()
    testinfra.backend.BACKENDS[BecomeSshBackend.NAME] = f"{__name__}.BecomeSshBackend"
