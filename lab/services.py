"""The lab's own services on the machine, on the bridge address: a registry
(Debian's docker-registry) and the model hub. Each is a process of its own
session with a PID file, so lab.down can end it and a crash can be recovered."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

from . import config, sh

REGISTRY_CONFIG = """\
version: 0.1
log:
  level: warn
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
http:
  addr: {addr}
"""


def _pidfile(name):
    return config.STATE / f"{name}.pid"


def running(name) -> int | None:
    try:
        pid = int(_pidfile(name).read_text())
        os.kill(pid, 0)
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            if b"dgemma-lab" not in handle.read() and name != "registry":
                return None
        return pid
    except (OSError, ValueError):
        return None


def _wait_port(port, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((config.GATEWAY, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise sh.LabError(f"nothing answers on {config.GATEWAY}:{port} after {timeout} s")


def _spawn(name, args, env=None):
    log = open(config.STATE / f"{name}.log", "ab")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                            env=env)
    _pidfile(name).write_text(str(proc.pid))


def ensure_registry():
    if running("registry"):
        return
    root = config.CACHE / "registry"
    root.mkdir(parents=True, exist_ok=True)
    conf = config.STATE / "registry.yml"
    conf.write_text(REGISTRY_CONFIG.format(root=root, addr=config.REGISTRY))
    _spawn("registry", ["docker-registry", "serve", str(conf)])
    _wait_port(config.REGISTRY_PORT)


def ensure_hub():
    if running("hub"):
        return
    env = dict(os.environ, PYTHONPATH=str(config.HERE.parent))
    _spawn("hub", [sys.executable, "-m", "lab.hub", config.GATEWAY, str(config.HUB_PORT), "dgemma-lab"], env=env)
    _wait_port(config.HUB_PORT)


def stop(name):
    pid = running(name)
    if pid:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except OSError:
                break
            time.sleep(0.1)
        else:
            os.killpg(pid, signal.SIGKILL)
    _pidfile(name).unlink(missing_ok=True)
