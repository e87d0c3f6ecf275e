"""`invoke logs`: the vLLM replicas' journal from each host, prefixed by host (a host with no
replica, a gateway or a monitoring host: the journal of the fleet's units it has).
The engine streams it over each host's transport (converge.group); this module
only says what to run, and what a host that has no such replica answers."""
from __future__ import annotations

import sys
import threading

from converge.group import stream

from day2.readings import PROGRAMS, replica_units
from serving.host_programs import Program, Protocol
from serving.replicas import families, from_unit, replica

NO_REPLICA = 3  # the exit status of a host that has no replica of the index asked for


JOURNAL = Protocol("the replicas' journal", exits={"no_replica": NO_REPLICA})
# the fleet's units other than the replicas' (their unit files): a host with no replica shows theirs
OTHER_UNITS = ("/etc/systemd/system/*-dgemma-*.service", "/etc/systemd/system/dgemma-*.service",
               "/etc/systemd/system/keepalived.service", "/lib/systemd/system/keepalived.service",
               "/usr/lib/systemd/system/keepalived.service")
JOURNAL_PROGRAM = Program((PROGRAMS / "units.sh", PROGRAMS / "journal.sh"), JOURNAL)


def journal_command(lines: int, follow: bool, index: int | None = None):
    """Every replica unit the host has (or the one of index ``index``) in one journalctl
    (host_programs/journal.sh); with several, each line names its unit (``-o with-unit``). A host
    without that replica lists the units it has on stderr and exits NO_REPLICA; a host with no
    replica at all (a gateway, a monitoring host) shows the fleet's other units it has."""
    def command(hostvars: dict) -> str:
        # the replica's unit under each family's name: whichever the host has
        wanted = "" if index is None else " ".join(replica(hostvars, index, f).unit_path for f in families())
        return JOURNAL_PROGRAM.script({**replica_units(hostvars), "WANTED": wanted, "OTHER_UNITS": " ".join(OTHER_UNITS),
                                       "LINES": int(lines), "FOLLOW": int(follow)})
    return command


def no_replica(host: str, hostvars: dict, index: int, units_listed: str) -> str:
    """What to say of a host that has no replica ``index``: the replicas it has, by index."""
    has = sorted({r.index for r in (from_unit(hostvars, u) for u in units_listed.split()) if r is not None})
    return (f"{host} has no replica {index} (it has {', '.join(map(str, has)) or 'none'}): "
            f"see invoke status --hosts {host}")


def stream_logs(play, hosts: list[str], lines: int, follow: bool, out=sys.stdout, replica: int | None = None) -> bool:
    lock = threading.Lock()
    width = max((len(h) for h in hosts), default=4)

    def emit(host, line):
        with lock:
            out.write(f"{host:<{width}} | {line}\n")
            out.flush()

    def failed(host, message):
        if replica is not None and message.startswith(f"exit {NO_REPLICA}:"):
            emit(host, no_replica(host, play.hostvars(host), replica, message.split(":", 1)[1]))
        else:
            emit(host, f"journalctl failed: {message}")

    command = journal_command(lines, follow, replica)
    with play.connections() as connections:
        failed_hosts = stream(connections, {h: command(play.hostvars(h)) for h in hosts}, emit, failed)
    return bool(failed_hosts)
