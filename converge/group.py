"""The hosts of one run, each reached once (Fabric's Group, for our transports).

A transport per host is opened on first need, in the thread that needs it, and
shared by all that the run does there (deploy's steps, verify's checks, a log
stream); jump hosts are shared too (one connection per bastion). All close
together at the end of the run.
"""
from __future__ import annotations

import threading
from collections import defaultdict

from .errors import ConvergeError
from .transport import Transport
from .transport.connect import JumpHosts


class Connections:
    """``opener(name, jumps)`` opens a host's transport (raising ConnectionFailed)."""

    def __init__(self, opener):
        self._opener = opener
        self.jumps = JumpHosts()
        self._open: dict[str, Transport] = {}
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self._closed = False

    def get(self, name: str) -> Transport:
        with self._locks[name]:
            if name not in self._open:
                if self._closed:
                    raise ConvergeError(f"{name}: the run is over")
                self._open[name] = self._opener(name, self.jumps)
            return self._open[name]

    def opened(self) -> dict[str, Transport]:
        return dict(self._open)

    def close(self):
        self._closed = True
        for transport in list(self._open.values()):
            transport.close()
        self.jumps.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def stream(connections: Connections, scripts: dict[str, str], on_line, on_error) -> list[str]:
    """Run each host's script at once and hand each line of output to
    ``on_line(host, line)`` as it comes (``invoke logs --follow``); what went wrong
    goes to ``on_error(host, message)``. Returns the hosts that failed. Ctrl-C
    ends the wait (the caller closes the connections)."""
    failed: list[str] = []

    def one(host):
        try:
            result = connections.get(host).run(scripts[host], on_output=lambda line: on_line(host, line))
            if result.rc != 0:
                on_error(host, f"exit {result.rc}: {result.stderr.strip()[-400:]}")
                failed.append(host)
        except ConvergeError as exc:
            on_error(host, str(exc))
            failed.append(host)

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in scripts]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except KeyboardInterrupt:
        pass
    return failed
