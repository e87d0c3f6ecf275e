"""The one readiness loop: what "a replica is ready" means, as shell every program that
starts replicas shares (the start role, a roll's gate, day 2): files/ready.sh, after
files/prelude.sh (``say``, ``now_ms``, and ``auth``: the key on curl's stdin). Ready is
vLLM's own /health answering, then /v1/models answering the key, on the replica's
loopback port. A unit that fails, goes inactive, or that systemd restarts (its
container exited) fails the wait at once, not after the timeout.

Its markers are part of the protocol of every program that includes it; the readers
here take that protocol."""
from __future__ import annotations

from pathlib import Path

from roles.host_programs import Protocol

FILES = Path(__file__).parent / "files"
PRELUDE = FILES / "prelude.sh"
READY = FILES / "ready.sh"
READY_MARKERS = {
    "replica-ready": "UNIT MS: this replica answers",
    "ready": "MS: every replica answers",
    "failed": "UNIT STATE MS: its unit failed, went inactive or was restarted",
    "timeout": "MS UNIT...: these did not answer in time",
}


def ready_seconds(protocol: Protocol, stdout: str) -> float | None:
    """The time the whole wait took, from its @ready marker."""
    found = protocol.first(stdout, "ready")
    return int(found[0]) / 1000 if found else None


def replica_ready(protocol: Protocol, stdout: str) -> dict[str, float]:
    """Each replica's unit -> how long it took to answer."""
    return {fields[0]: int(fields[1]) / 1000 for fields in protocol.every(stdout, "replica-ready") if len(fields) == 2}


def late_units(protocol: Protocol, stdout: str) -> list[str]:
    """The units still not answering when the wait timed out."""
    found = protocol.first(stdout, "timeout")
    return found[1:] if found else []


def failed_unit(protocol: Protocol, stdout: str) -> tuple[str, str] | None:
    """The unit that failed the wait, and its state."""
    found = protocol.first(stdout, "failed")
    return (found[0], found[1]) if found and len(found) >= 2 else None
