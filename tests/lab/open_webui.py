"""Open WebUI (PyPI's open-webui, CPU torch) for the lab's browser test: installed in a venv of
its own (its pins are not ours) when the test starts and removed when it ends, so that its ~3 GB
are not on the disk while the lab's other tests run (the lab's hosts share this machine's disk,
and a deploy checks the room for the model's weights there); run offline with a data folder of
the test's own, on loopback."""
from __future__ import annotations

import os
import re
import shutil
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


def install() -> float:
    """Install it (pip's cache left alone: no copy of its wheels stays behind); the seconds it took."""
    started = time.monotonic()
    python = getattr(sys, "_base_executable", sys.executable)  # the interpreter our own venv was made from
    LOG.parent.mkdir(parents=True, exist_ok=True)
    script = (f"set -e; rm -rf {VENV}; {python} -m venv {VENV}; "
              f"{VENV}/bin/pip install -q --no-cache-dir --disable-pip-version-check torch=={TORCH}; "
              f"{VENV}/bin/pip install -q --no-cache-dir --disable-pip-version-check open-webui=={VERSION}")
    with open(LOG, "w") as log:
        proc = subprocess.run(["bash", "-c", script], stdout=log, stderr=subprocess.STDOUT, timeout=1200)
    assert proc.returncode == 0, f"installing Open WebUI {VERSION} failed: {LOG.read_text()[-3000:]}"
    return time.monotonic() - started


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
