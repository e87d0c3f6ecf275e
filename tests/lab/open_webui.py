"""Open WebUI (PyPI's open-webui, CPU torch) for the lab's browser test: installed in a venv of
its own (its pins are not ours), in the background from the start of a test run that has the lab
tests (tests/conftest.py), so that the lab tests before it pay none of its time; run offline
with a data folder of the test's own, on loopback."""
from __future__ import annotations

import os
import re
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
STAMP = VENV / f".installed-{VERSION}"
LOG = ROOT / ".test-output" / "open-webui-install.log"
PID = ROOT / ".test-output" / "open-webui-install.pid"


def install_command() -> list[str]:
    python = getattr(sys, "_base_executable", sys.executable)  # the interpreter our own venv was made from
    script = (f"set -e; rm -rf {VENV}; {python} -m venv {VENV}; "
              f"{VENV}/bin/pip install -q --disable-pip-version-check torch=={TORCH}; "
              f"{VENV}/bin/pip install -q --disable-pip-version-check open-webui=={VERSION}; "
              f"touch {STAMP}")
    # below the lab's hosts in the queue for the cores and the disk
    return ["nice", "-n", "19", "ionice", "-c", "3", "bash", "-c", script]


def start_install() -> None:
    """Begin the install in the background unless it is there or under way."""
    if STAMP.exists():
        return
    if PID.exists():
        try:
            os.kill(int(PID.read_text()), 0)
            return  # under way
        except (OSError, ValueError):
            pass
    LOG.parent.mkdir(parents=True, exist_ok=True)
    with open(LOG, "w") as log:
        proc = subprocess.Popen(install_command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    PID.write_text(str(proc.pid))


def wait_installed(timeout: float = 900) -> None:
    """Wait for the background install (or run it here when none was started)."""
    start_install()
    deadline = time.monotonic() + timeout
    while not STAMP.exists():
        try:
            os.kill(int(PID.read_text()), 0)
        except (OSError, ValueError):
            raise AssertionError(f"installing Open WebUI {VERSION} failed: {LOG.read_text()[-3000:]}") from None
        assert time.monotonic() < deadline, f"installing Open WebUI took over {timeout:.0f} s: {LOG}"
        time.sleep(1)


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
