"""Run one command on many hosts at once and hand each line of output to a
callback as it comes (``invoke logs --follow``): the engine's connections, so
jump hosts and become work as for a deploy; no lock, no facts.
"""
from __future__ import annotations

import threading

from .connection import SSHConnection
from .errors import ConvergeError
from .fabric_ssh import JumpHosts


def stream(play, hosts: list[str], command_for, on_line, on_error) -> list[str]:
    """``command_for(hostvars)`` gives each host's script; ``on_line(host, line)``
    gets its output, ``on_error(host, message)`` what went wrong. Returns the
    hosts that failed. Ctrl-C ends the wait (the connections close)."""
    failed: list[str] = []
    jumps = JumpHosts()
    connections: list = []
    lock = threading.Lock()

    def one(host):
        try:
            conn = SSHConnection(play.ssh_settings(host), jumps).open()
            with lock:
                connections.append(conn)
            result = conn.run(command_for(play.hostvars(host)), timeout=None,
                              on_output=lambda line: on_line(host, line))
            if result.rc != 0:
                on_error(host, f"exit {result.rc}: {result.stderr.strip()[-400:]}")
                failed.append(host)
        except ConvergeError as exc:
            on_error(host, str(exc))
            failed.append(host)

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in hosts]
    for thread in threads:
        thread.start()
    try:
        for thread in threads:
            while thread.is_alive():
                thread.join(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        with lock:
            for conn in connections:
                conn.close()
        jumps.close()
    return failed
