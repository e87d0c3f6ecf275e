"""Open WebUI (PyPI's open-webui, CPU torch) for the lab's browser test: installed in a venv of
its own (its pins are not ours) and removed when the test ends; run offline with a data folder of
the test's own, on loopback.

The install (~3 GB, 80 to 190 s) begins in the background when the lab's session does, at the
lowest CPU priority, so that it is done by the time the browser test comes and the lab's tests
keep the cores meanwhile: the suite's one long line is the lab's tests, one after another. It waits
for the test itself where the disk has less than INSTALL_ROOM_MIB free (the lab's hosts share this
machine's disk, and a deploy checks the room for the model's weights there)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
VERSION = "0.12.4"
# the CPU build this machine kind keeps on disk for Python 3.11 (pip takes it from there); any
# other torch is a CUDA build of several GB
TORCH = "2.13.0"
VENV = ROOT / ".venv-openwebui"
LOG = ROOT / ".test-output" / "open-webui-install.log"


# Open WebUI's ~3 GB and what the lab's deploys check the room for (a model's weights and
# min_free_disk_mib), with room to spare
INSTALL_ROOM_MIB = 16 * 1024
_background: dict = {}


def _install_script(compile_modules: bool) -> str:
    """The venv, then CPU torch, then Open WebUI; pip's cache left alone (no copy of its wheels
    stays behind). Byte-compiling the ~20,000 modules takes half the install's time: done in the
    background, where it costs the lab's tests nothing and spares Open WebUI's start compiling what
    it imports; not where the test waits for the install."""
    python = getattr(sys, "_base_executable", sys.executable)  # the interpreter our own venv was made from
    pip = (f"{VENV}/bin/pip install -q --no-cache-dir {'' if compile_modules else '--no-compile '}"
           f"--disable-pip-version-check")
    return f"set -e; rm -rf {VENV}; {python} -m venv {VENV}; {pip} torch=={TORCH}; {pip} open-webui=={VERSION}"


def _begin(nice: bool) -> None:
    LOG.parent.mkdir(parents=True, exist_ok=True)
    command = ["bash", "-c", _install_script(compile_modules=nice)]
    with open(LOG, "w") as log:
        _background["proc"] = subprocess.Popen(["nice", "-n", "19", *command] if nice else command, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)
    _background["started"] = time.monotonic()


def install_in_background() -> bool:
    """Begin the install now, at the lowest CPU priority, where the disk has room for it while the
    lab's tests run; whether it began."""
    if "proc" in _background or shutil.disk_usage(ROOT).free < INSTALL_ROOM_MIB * 2**20:
        return False
    _begin(nice=True)
    return True


def install() -> float:
    """Open WebUI installed: the background install waited for, or one begun now; the seconds it
    took from its beginning."""
    if "proc" not in _background:
        _begin(nice=False)
    proc, started = _background["proc"], _background["started"]
    try:
        proc.wait(timeout=1200)
    finally:
        _background.clear()
    assert proc.returncode == 0, f"installing Open WebUI {VERSION} failed: {LOG.read_text()[-3000:]}"
    return time.monotonic() - started


def abandon() -> None:
    """A background install the session did not come to use: stopped, and what it wrote removed."""
    proc = _background.pop("proc", None)
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    _background.clear()
    if proc is not None:
        remove()


def remove() -> None:
    shutil.rmtree(VENV, ignore_errors=True)


def endpoint_lines(text: str) -> dict[str, str]:
    """The ``NAME="value"`` lines of `invoke endpoints`, as a shell (or a .env file) reads them."""
    return dict(re.findall(r'^([A-Z][A-Z0-9_]*)="([^"]*)"$', text, re.M))


class Server:
    """``open-webui serve`` on loopback with ``env`` over a minimal environment: its own data
    folder, offline, one user and no sign-in (WEBUI_AUTH=False, a single-user install)."""

    def __init__(self, env: dict[str, str], data: Path, port: int, log: Path):
        self.url, self.log = f"http://127.0.0.1:{port}", log
        data.mkdir(parents=True, exist_ok=True)
        base = {k: os.environ[k] for k in ("PATH", "LANG", "HOME") if k in os.environ}
        self.env = {**base, "DATA_DIR": str(data), "WEBUI_AUTH": "False", "OFFLINE_MODE": "True",
                    "WEBUI_SECRET_KEY": "lab-browser-test", "ENABLE_VERSION_UPDATE_CHECK": "False",
                    "ANONYMIZED_TELEMETRY": "False", "DO_NOT_TRACK": "True", **env}
        self.port = port
        self.proc = None

    def start(self, timeout: float = 180) -> float:
        """Start it and wait until /health answers; the seconds it took."""
        started = time.monotonic()
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen([str(VENV / "bin" / "open-webui"), "serve", "--host", "127.0.0.1",
                                          "--port", str(self.port)], env=self.env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return time.monotonic() - started
            except OSError:
                pass
            assert self.proc.poll() is None, f"Open WebUI exited: {self.log.read_text()[-3000:]}"
            assert time.monotonic() - started < timeout, f"Open WebUI did not answer in {timeout:.0f} s: {self.log}"
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
