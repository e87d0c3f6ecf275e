"""A host's vLLM replicas: one per GPU (or tensor-parallel group) the placement
gives, each its own container, unit and loopback port. Replica 0 keeps the
service's own name, so a one-GPU host, and every host deployed before replicas
existed, keeps its unit as it is; replica N is ``<service_name>-N`` on
``replica_base_port + N``. Pure."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

DEFAULT_SERVICE = "vllm-diffusiongemma"
UNIT_DIR = "/etc/systemd/system"


@dataclass(frozen=True)
class Served:
    """What one replica runs: a model of a family, a memory fraction, its GPUs by uuid (none:
    every GPU, as a unit rendered without a placement), its tensor-parallel size and the
    serving settings its family's ``models:`` entry sets for it alone."""
    index: int
    model: str
    utilization: float
    gpus: tuple = ()
    tensor_parallel_size: int = 1
    family: str = "diffusiongemma"
    settings: tuple = ()  # (name, value) pairs over the host's variables

    @classmethod
    def of(cls, replica) -> "Served":
        """From a placement's replica (roles/preflight/placement.Replica)."""
        return cls(replica.index, replica.model, replica.utilization, tuple(g["uuid"] for g in replica.gpus),
                   replica.tensor_parallel_size, replica.family,
                   tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in sorted(replica.settings.items())))

    def variables(self, v: dict) -> dict:
        """The host's variables with this replica's own settings over them."""
        return {**v, **{k: list(x) if isinstance(x, tuple) else x for k, x in self.settings}}


def service(v: dict) -> str:
    return v.get("service_name", DEFAULT_SERVICE)


def replica_name(v: dict, index: int) -> str:
    """The container's name (and the unit's, after the runtime)."""
    return service(v) if index == 0 else f"{service(v)}-{index}"


def replica_unit(v: dict, index: int) -> str:
    return f"{v.get('container_runtime', 'podman')}-{replica_name(v, index)}.service"


def replica_unit_path(v: dict, index: int) -> str:
    return f"{UNIT_DIR}/{replica_unit(v, index)}"


def replica_port(v: dict, index: int) -> int:
    return int(v.get("replica_base_port", 8100)) + index


def more_units_glob(v: dict) -> str:
    """The unit files of replicas 1 and up (service_name is schema-checked: no glob in it)."""
    return f"{UNIT_DIR}/{v.get('container_runtime', 'podman')}-{service(v)}-[0-9]*.service"


def units_shell(v: dict) -> str:
    """Shell that sets ``$units`` to the replica units the host has (replica 0's when it has
    none), for day-2 commands that run without facts."""
    first = replica_unit(v, 0)
    # unit names are schema-checked (no pattern characters): an exact grep of the folder
    pattern = shlex.quote(f"^{first.removesuffix('.service')}(-[1-9][0-9]*)?[.]service$")
    return (f"units=$(ls {UNIT_DIR} 2>/dev/null | grep -E {pattern}); "
            f"[ -n \"$units\" ] || units={shlex.quote(first)}")


def index_of(v: dict, unit: str) -> int | None:
    """Which replica a unit (name or path) is, or None when it is none of this service's."""
    name = unit.rsplit("/", 1)[-1]
    prefix = f"{v.get('container_runtime', 'podman')}-"
    if not (name.startswith(prefix) and name.endswith(".service")):
        return None
    return index_of_container(v, name[len(prefix):-len(".service")])


def index_of_container(v: dict, name: str) -> int | None:
    """Which replica a container name is, or None when it is none of this service's."""
    if name == service(v):
        return 0
    match = re.fullmatch(re.escape(service(v)) + r"-([1-9][0-9]*)", name)
    return int(match.group(1)) if match else None


def installed(v: dict, first_unit: dict | None, more_units: dict | None) -> dict[int, dict]:
    """Replica index -> its unit's state, for every replica unit the host has: replica 0's
    from its UnitState fact (absent when systemd does not know it), the others from the
    UnitFiles fact of ``more_units_glob``."""
    found = {}
    if first_unit and first_unit.get("LoadState") not in (None, "not-found"):
        found[0] = first_unit
    for path, unit in (more_units or {}).items():
        index = index_of(v, path)
        if index:
            found[index] = unit["state"]
    return dict(sorted(found.items()))


def chosen(indices, wanted: int | None) -> list[int]:
    """The replicas a day-2 command acts on: all of them, or the one ``--replica`` names."""
    return [i for i in indices if wanted is None or i == wanted]
