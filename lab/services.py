"""The lab's own services on the machine, on the bridge address: a registry
(Debian's docker-registry) and the model hub. Each is a process of its own
session with a PID file, so lab.down can end it and a crash can be recovered."""
from __future__ import annotations

import json
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


def _wait_port(port, address=config.GATEWAY, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise sh.LabError(f"nothing answers on {address}:{port} after {timeout} s")


def _spawn(name, args, env=None):
    log = open(config.STATE / f"{name}.log", "ab")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True,
                            env=env)
    _pidfile(name).write_text(str(proc.pid))
    (config.STATE / f"{name}.args").write_text(json.dumps([str(a) for a in args]))


def _current(name, args) -> bool:
    """Whether ``name`` runs, as ``args`` say (a lab of an earlier layout is restarted)."""
    if not running(name):
        return False
    try:
        same = json.loads((config.STATE / f"{name}.args").read_text()) == [str(a) for a in args]
    except (OSError, ValueError):
        same = False
    if not same:
        stop(name)
    return same


def ensure_registry():
    root = config.CACHE / "registry"
    conf = config.STATE / "registry.yml"
    text = REGISTRY_CONFIG.format(root=root, addr=config.REGISTRY_LOCAL)
    args = ["docker-registry", "serve", str(conf)]
    if _current("registry", args) and conf.read_text() == text:
        return
    stop("registry")
    root.mkdir(parents=True, exist_ok=True)
    conf.write_text(text)
    _spawn("registry", args)
    _wait_port(int(config.REGISTRY_LOCAL.rsplit(":", 1)[1]), "127.0.0.1")


def ensure_hub():
    args = [sys.executable, "-m", "lab.hub", "127.0.0.1", str(config.HUB_LOCAL_PORT), "dgemma-lab",
            str(HUB_KNOBS), str(HUB_LOG)]
    if _current("hub", args):
        return
    env = dict(os.environ, PYTHONPATH=str(config.HERE.parent))
    _spawn("hub", args, env=env)
    _wait_port(config.HUB_LOCAL_PORT, "127.0.0.1")


UPLINK_KNOBS = config.STATE / "uplink.json"
UPLINK_STATS = config.STATE / "uplink-stats.json"
HUB_KNOBS = config.STATE / "hub.json"
HUB_LOG = config.STATE / "hub-access.log"


def ensure_uplink():
    """The lab network's way to the registry and the hub (lab/uplink.py)."""
    registry_local = config.REGISTRY_LOCAL.rsplit(":", 1)[1]
    args = [sys.executable, "-m", "lab.uplink", str(UPLINK_KNOBS), str(UPLINK_STATS),
            f"{config.GATEWAY}:{config.REGISTRY_PORT}:{registry_local}:registry",
            f"{config.GATEWAY}:{config.HUB_PORT}:{config.HUB_LOCAL_PORT}:hub", "dgemma-lab"]
    if _current("uplink", args):
        return
    if not UPLINK_KNOBS.exists():
        UPLINK_KNOBS.write_text('{"rate_mb_s": 0, "stalled": false}\n')
    env = dict(os.environ, PYTHONPATH=str(config.HERE.parent))
    _spawn("uplink", args, env=env)
    _wait_port(config.REGISTRY_PORT)
    _wait_port(config.HUB_PORT)


def set_uplink(**knobs):
    """Change the uplink's knobs (rate_mb_s, stalled); it reads them within 0.2 s."""
    current = uplink_knobs()
    current.update(knobs)
    tmp = UPLINK_KNOBS.with_suffix(".tmp")
    tmp.write_text(json.dumps(current) + "\n")
    tmp.replace(UPLINK_KNOBS)
    time.sleep(0.5)


def set_hub(**knobs):
    """Replace the hub's knobs (size_mib, corrupt); it reads them at every request."""
    tmp = HUB_KNOBS.with_suffix(".tmp")
    tmp.write_text(json.dumps(knobs) + "\n")
    tmp.replace(HUB_KNOBS)


def _json_or_empty(path) -> dict:
    """A knobs or stats file as a dict; {} while it is missing or half-written."""
    try:
        found = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return found if isinstance(found, dict) else {}


def hub_knobs() -> dict:
    return _json_or_empty(HUB_KNOBS)


def uplink_knobs() -> dict:
    return _json_or_empty(UPLINK_KNOBS)


def uplink_bytes() -> dict:
    """Bytes that crossed the uplink so far, per service: {"hub": {"down": n, ...}, ...}."""
    return _json_or_empty(UPLINK_STATS).get("services", {})


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
