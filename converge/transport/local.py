"""The machine we run on (``--local``, ``ansible_connection: local``), through
the same scripts as a host over SSH."""
from __future__ import annotations

import contextlib
import os
import select
import shlex
import signal
import subprocess
import threading

from ..become import Become
from . import Transport


class _Local:
    def __init__(self, name: str, command: str, stdin: bytes, keep_open: bool):
        self.name = name
        self._proc = subprocess.Popen(shlex.split(command), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, start_new_session=True)
        self._err = bytearray()
        self._err_reader = threading.Thread(target=lambda: self._err.extend(self._proc.stderr.read()), daemon=True)
        self._err_reader.start()
        self._lock = threading.Lock()
        self.write(stdin)
        if not keep_open:
            self._proc.stdin.close()

    def read(self, seconds):
        ready, _, _ = select.select([self._proc.stdout], [], [], seconds)
        return os.read(self._proc.stdout.fileno(), 65536) if ready else None

    def stderr(self):
        self._err_reader.join(0 if self._proc.poll() is None else 5)
        return bytes(self._err)

    def write(self, data):
        with self._lock, contextlib.suppress(BrokenPipeError):  # it ended: its output says why
            if data and not self._proc.stdin.closed:
                self._proc.stdin.write(data)
                self._proc.stdin.flush()

    def status(self, seconds):
        try:
            return self._proc.wait(seconds)
        except subprocess.TimeoutExpired:  # its output ended but it lingers: it has had its time
            self.kill()
            return self._proc.wait()

    def alive(self):
        return self._proc.poll() is None

    def kill(self):
        """A held script ends with its stdin (the host lock lets go); a run, at once."""
        with self._lock:
            held = not self._proc.stdin.closed
            self._proc.stdin.close()
        try:
            self._proc.wait(5 if held else 0)
        except subprocess.TimeoutExpired:
            os.killpg(self._proc.pid, signal.SIGKILL)
            self._proc.wait()


class LocalTransport(Transport):
    def __init__(self, name: str = "localhost", become: Become | None = None):
        self.name = name
        self.become = become
        self._held: list[_Local] = []

    def open(self) -> "LocalTransport":
        return self

    def _start(self, command, stdin, keep_open, timeout):
        proc = _Local(self.name, command, stdin, keep_open)
        self._held += [proc] if keep_open else []
        return proc

    def close(self):
        for proc in self._held:
            proc.kill()
        self._held = []
