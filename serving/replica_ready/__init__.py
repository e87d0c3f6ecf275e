"""The one readiness loop: what "a replica is ready" means, as shell every program that
starts replicas shares (the start role, a roll's gate, day 2): files/ready.sh, after
files/prelude.sh (``say``, ``now_ms``, and ``auth``: the key on curl's stdin). Ready is
vLLM's own /health answering, then /v1/models answering the key, on the replica's
loopback port. A unit that fails, goes inactive, or that systemd restarts (its
container exited) fails the wait at once, not after the timeout.

Its marker (each replica as it answers) is part of the protocol of every program that
includes it; how the wait ended is that program's to say, in its result line, from what
the loop sets (ready.sh)."""
from __future__ import annotations

from pathlib import Path

from serving.host_programs import Protocol

FILES = Path(__file__).parent / "files"
PRELUDE = FILES / "prelude.sh"
READY = FILES / "ready.sh"
READY_MARKERS = {"replica-ready": "UNIT MS: this replica answers"}


def replica_ready(protocol: Protocol, stdout: str) -> dict[str, float]:
    """Each replica's unit -> how long it took to answer."""
    return {fields[0]: int(fields[1]) / 1000 for fields in protocol.every(stdout, "replica-ready") if len(fields) == 2}
