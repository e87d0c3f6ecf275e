"""`invoke logs`: the vLLM unit's journal from each host, prefixed by host.
The engine streams it over each host's transport (converge.group); this module
only says what to run."""
from __future__ import annotations

import shlex
import sys
import threading

from converge.group import stream

from roles.replicas import replica_unit, units_shell


def journal_command(lines: int, follow: bool, replica: int | None = None):
    """Every replica unit the host has (or the one ``replica`` names) in one journalctl;
    with several, each line names its unit (``-o with-unit``)."""
    def command(hostvars: dict) -> str:
        units = (units_shell(hostvars) if replica is None else
                 f"units={shlex.quote(replica_unit(hostvars, replica))}")
        return (f"{units}; set --; for u in $units; do set -- \"$@\" -u \"$u\"; done; "
                f"format=short-iso; [ $# -gt 2 ] && format=with-unit; "
                f"exec journalctl \"$@\" -n {int(lines)} --no-pager -o $format" + (" -f" if follow else "") + "\n")
    return command


def stream_logs(play, hosts: list[str], lines: int, follow: bool, out=sys.stdout, replica: int | None = None) -> bool:
    lock = threading.Lock()
    width = max((len(h) for h in hosts), default=4)

    def emit(host, line):
        with lock:
            out.write(f"{host:<{width}} | {line}\n")
            out.flush()

    command = journal_command(lines, follow, replica)
    with play.connections() as connections:
        failed = stream(connections, {h: command(play.hostvars(h)) for h in hosts}, emit,
                        lambda host, message: emit(host, f"journalctl failed: {message}"))
    return bool(failed)
