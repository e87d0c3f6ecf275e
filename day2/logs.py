"""`invoke logs`: the vLLM unit's journal from each host, prefixed by host.
The engine streams it over each host's transport (converge.group); this module
only says what to run."""
from __future__ import annotations

import shlex
import sys
import threading

from converge.group import stream

from roles.service.role import unit_name


def journal_command(lines: int, follow: bool):
    def command(hostvars: dict) -> str:
        return (f"journalctl -u {shlex.quote(unit_name(hostvars))} -n {int(lines)} --no-pager -o short-iso"
                + (" -f" if follow else "") + "\n")
    return command


def stream_logs(play, hosts: list[str], lines: int, follow: bool, out=sys.stdout) -> bool:
    lock = threading.Lock()
    width = max((len(h) for h in hosts), default=4)

    def emit(host, line):
        with lock:
            out.write(f"{host:<{width}} | {line}\n")
            out.flush()

    command = journal_command(lines, follow)
    with play.connections() as connections:
        failed = stream(connections, {h: command(play.hostvars(h)) for h in hosts}, emit,
                        lambda host, message: emit(host, f"journalctl failed: {message}"))
    return bool(failed)
