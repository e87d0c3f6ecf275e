"""What the roles of a serving host share, in one place that imports no role:
where the service's files live on the host (its environment file, the notes each
replica writes as it starts, the image record), the name of the handler that
restarts a replica, the address at which the host reaches its own front door, and
the facts of the replicas' units.

Each role reads these here instead of reaching into another role's ``role.py``,
so a role's internals can change without breaking the others. Pure."""
from __future__ import annotations

from converge.facts.host import UnitFiles

from serving.replicas import Replica, service, unit_fact, unit_globs

STATE_DIR = "/var/lib/dgemma"  # what deploy records on the host (the image it pulled)
STAMP_DIR = "/run/dgemma"  # what a replica notes as it starts (gone at reboot, as the process is)
UNITS_FACT = "replica_units"  # every replica unit of the host: its file and its state


def units_fact(v: dict) -> dict:
    """The fact of every replica unit the host has (each family's names)."""
    return {UNITS_FACT: UnitFiles(*unit_globs(v))}


def env_path(v: dict) -> str:
    """Every replica's secrets: one file, the same keys."""
    return f"/etc/dgemma/{service(v)}.env"


def record_path(v: dict) -> str:
    """The image record: which image (digest, arch) the tag named when the image role pulled it."""
    return f"{STATE_DIR}/{service(v)}.image"


def env_stamp_path(replica: Replica) -> str:
    """Where a replica's unit notes, as it starts, the sha256 of the environment file it read."""
    return f"{STAMP_DIR}/{replica.container}.env-started"


def image_stamp_path(replica: Replica) -> str:
    """Where a replica's unit notes, as it starts, the image record it started under."""
    return f"{STAMP_DIR}/{replica.container}.image-started"


def restart(unit: str) -> str:
    """The handler that restarts one replica's unit (the service role declares it)."""
    return f"restart {unit}"


def step_name(step: str, index: int) -> str:
    """Replica 0's steps keep the names they had before replicas existed."""
    return step if index == 0 else f"{step} (replica {index})"


def connect_address(v: dict) -> str:
    """Where the host itself reaches its front door (or gateway): loopback when it binds every address."""
    host = v.get("api_host", "0.0.0.0")
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def unit_state(ctx, replica: Replica) -> dict:
    """A replica's UnitState as gathered (empty when the host has no such unit)."""
    return unit_fact(ctx.facts.get(UNITS_FACT), replica).get("state") or {}


def unit_file(ctx, replica: Replica) -> dict | None:
    """A replica's unit file (FileState) as gathered (None when absent)."""
    return unit_fact(ctx.facts.get(UNITS_FACT), replica).get("file")


def is_running(unit_state: dict | None) -> bool:
    unit_state = unit_state or {}
    return unit_state.get("ActiveState") == "active" and unit_state.get("SubState") == "running"
