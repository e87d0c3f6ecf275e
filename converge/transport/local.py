"""The machine we run on (``--local``, ``ansible_connection: local``), through
the same scripts as a host over SSH."""
from __future__ import annotations

import os
import select
import shlex
import signal
import subprocess
import threading
import time

from ..become import Become
from . import Process, Transport, keep_tail


class _Local(Process):
    def __init__(self, name: str, command: str, stdin: bytes, keep_open: bool):
        self.name = name
        self._proc = subprocess.Popen(shlex.split(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        self._err = bytearray()
        self._err_open = True
        self._lock = threading.Lock()
        self.write(stdin)
        if not keep_open:
            self._proc.stdin.close()

    def read(self, seconds):
        deadline = time.monotonic() + seconds
        out, err = self._proc.stdout.fileno(), self._proc.stderr.fileno()
        while True:
            ready, _, _ = select.select([out] + ([err] if self._err_open else []), [], [],
                                        max(deadline - time.monotonic(), 0))
            if not ready:
                return None
            if err in ready:
                chunk = os.read(err, 65536)
                self._err += chunk
                keep_tail(self._err)
                self._err_open = bool(chunk)
            if out in ready:
                return os.read(out, 65536)

    def stderr(self):
        return bytes(self._err)

    def write(self, data):
        with self._lock:
            if data and not self._proc.stdin.closed:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()

    def status(self, seconds):
        try:
            return self._proc.wait(seconds)
        except subprocess.TimeoutExpired:  # its output ended but it lingers: it has had its time
            os.killpg(self._proc.pid, signal.SIGKILL)
            return self._proc.wait()

    def alive(self):
        return self._proc.poll() is None

    def kill(self):
        """A held script ends at the end of its stdin (the lock lets go); a run
        (its stdin already closed), at once."""
        try:
            with self._lock:
                held = not self._proc.stdin.closed
                if held:
                    self._proc.stdin.close()
            if not held:
                raise OSError("a run is ended at once")
            self._proc.wait(5)
        except (OSError, subprocess.TimeoutExpired):
            if self._proc.poll() is None:
                os.killpg(self._proc.pid, signal.SIGKILL)
                self._proc.wait()


class LocalTransport(Transport):
    def __init__(self, name: str = "localhost", become: Become | None = None):
        self.name = name
        self.become = become
        self._procs: list[_Local] = []

    def open(self) -> "LocalTransport":
        return self

    def _start(self, command, stdin, keep_open, timeout):
        proc = _Local(self.name, command, stdin, keep_open)
        if keep_open:
            self._procs.append(proc)
        return proc

    def close(self):
        for proc in self._procs:
            proc.kill()
        self._procs = []
