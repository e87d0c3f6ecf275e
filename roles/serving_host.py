"""What the roles of a serving host share, in one place that imports no role:
where the service's files live on the host (its environment file, the notes each
replica writes as it starts, the image record), the name of the handler that
restarts a replica, and the address at which the host reaches its own front door.

Each role reads these here instead of reaching into another role's ``role.py``,
so a role's internals can change without breaking the others. Pure."""
from __future__ import annotations

import shlex

from roles.replicas import replica_name, replica_unit, replica_unit_path, service

STATE_DIR = "/var/lib/dgemma"  # what deploy records on the host (the image it pulled)
STAMP_DIR = "/run/dgemma"  # what a replica notes as it starts (gone at reboot, as the process is)


def unit_name(v: dict) -> str:
    """Replica 0's unit: the service's own name, as before replicas existed."""
    return replica_unit(v, 0)


def unit_path(v: dict) -> str:
    return replica_unit_path(v, 0)


def env_path(v: dict) -> str:
    """Every replica's secrets: one file, the same keys."""
    return f"/etc/dgemma/{service(v)}.env"


def record_path(v: dict) -> str:
    """The image record: which image (digest, arch) the tag named when the image role pulled it."""
    return f"{STATE_DIR}/{service(v)}.image"


def env_stamp_path(v: dict, index: int = 0) -> str:
    """Where a replica's unit notes, as it starts, the sha256 of the environment file it read."""
    return f"{STAMP_DIR}/{replica_name(v, index)}.env-started"


def image_stamp_path(v: dict, index: int = 0) -> str:
    """Where a replica's unit notes, as it starts, the image record it started under."""
    return f"{STAMP_DIR}/{replica_name(v, index)}.image-started"


def start_notes_command(v: dict, index: int = 0) -> str:
    """The shell that writes both notes as the replica starts (systemd reads EnvironmentFile
    just before), so a deploy sees a replica still running an older environment or image."""
    image_stamp = shlex.quote(image_stamp_path(v, index))
    return (f"mkdir -p {STAMP_DIR} && sha256sum < {shlex.quote(env_path(v))} > "
            f"{shlex.quote(env_stamp_path(v, index))} && {{ cp -f {shlex.quote(record_path(v))} {image_stamp} "
            f"2>/dev/null || rm -f {image_stamp}; }}")


def restart(unit: str) -> str:
    """The handler that restarts one replica's unit (the service role declares it)."""
    return f"restart {unit}"


def restart_all(ctx) -> tuple:
    """The handlers that restart every planned replica (a new image, new weights for all)."""
    return tuple(restart(replica_unit(ctx.vars, r.index)) for r in ctx.desired["choice"].replicas)


def step_name(step: str, index: int) -> str:
    """Replica 0's steps keep the names they had before replicas existed."""
    return step if index == 0 else f"{step} (replica {index})"


def connect_address(v: dict) -> str:
    """Where the host itself reaches its front door (or gateway): loopback when it binds every address."""
    host = v.get("api_host", "0.0.0.0")
    return "127.0.0.1" if host in ("0.0.0.0", "::") else host


def replica_units_fact(ctx, index: int) -> dict:
    """Replica ``index``'s entry (1 and up) of the UnitFiles fact ``replica_units``: its file and state."""
    return (ctx.facts.get("replica_units") or {}).get(replica_unit_path(ctx.vars, index)) or {}


def unit_state(ctx, index: int) -> dict:
    """A replica's UnitState as gathered (``unit`` for replica 0, ``replica_units`` for the
    others; empty when the host has no such unit)."""
    return (ctx.facts.get("unit") or {}) if index == 0 else replica_units_fact(ctx, index).get("state") or {}


def unit_file(ctx, index: int) -> dict | None:
    """A replica's unit file (FileState) as gathered (None when absent)."""
    return ctx.facts.get("unit_file") if index == 0 else replica_units_fact(ctx, index).get("file")
