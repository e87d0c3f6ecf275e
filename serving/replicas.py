"""Who a replica is on its host, in one place: its index, the model family it serves,
its GPUs, and every name made from them (its container, its unit and the unit's file,
its loopback port, its server in the front door), with the parse of each name back to
the replica. Every role, day-2 command and bench names a replica through this module;
host-side scripts get the names it makes as a table of NAME=VALUE words (`shell_table`,
read there by serving/files/replicas.sh).

A replica's index follows its GPUs (roles/preflight/placement.py) and numbers it on the
host, whatever family it serves: it gives the port (``replica_base_port + index``) and
the front door's server (``replica<index>``). The container is the family's service
name, and ``-<index>`` after it for every replica but 0: DiffusionGemma's service is
``service_name`` (``vllm-diffusiongemma``), so a one-GPU host, and every host deployed
before families existed, keeps its unit; another family's service says the family
(``vllm-gemma4``; hgx01's Gemma 4 on GPU 2 is ``vllm-gemma4-2``, unit
``podman-vllm-gemma4-2.service``). Pure."""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from serving import catalog
from serving.catalog import DEFAULT_FAMILY
from serving.host_programs import NAME_VALUE_TABLE

DEFAULT_SERVICE = "vllm-diffusiongemma"
UNIT_DIR = "/etc/systemd/system"
SERVER_PREFIX = "replica"  # the front door's server of replica N is replica<N>
DEFAULT_BASE_PORT = 8100


def service(v: dict) -> str:
    """The host's service name (``service_name``): DiffusionGemma's replicas, and the name of
    the files every replica shares (the environment file, the image record)."""
    return v.get("service_name", DEFAULT_SERVICE)


def family_service(v: dict, family: str) -> str:
    """The name a family's replicas take: ``service_name`` for DiffusionGemma, else the
    same with the family in place of DiffusionGemma's (``vllm-gemma4``), or after it when
    ``service_name`` does not end in it (``dg`` -> ``dg-gemma4``)."""
    name = service(v)
    if family == DEFAULT_FAMILY:
        return name
    return f"{name.removesuffix('-' + DEFAULT_FAMILY)}-{family}"


def runtime(v: dict) -> str:
    return v.get("container_runtime", "podman")


def base_port(v: dict) -> int:
    return int(v.get("replica_base_port", DEFAULT_BASE_PORT))


def port(v: dict, index: int) -> int:
    """Replica ``index``'s loopback port on a host with these variables."""
    return base_port(v) + int(index)


@dataclass(frozen=True)
class Replica:
    """One replica of a host: what names it there."""
    index: int
    family: str
    service: str  # the family's service name on this host
    runtime: str
    base_port: int
    gpus: tuple = ()  # the GPUs it is handed, by uuid (none: not known, or every GPU)

    @property
    def container(self) -> str:
        return self.service if self.index == 0 else f"{self.service}-{self.index}"

    @property
    def unit(self) -> str:
        return f"{self.runtime}-{self.container}.service"

    @property
    def unit_path(self) -> str:
        return f"{UNIT_DIR}/{self.unit}"

    @property
    def port(self) -> int:
        return port({"replica_base_port": self.base_port}, self.index)

    @property
    def server(self) -> str:
        """Its server in the front door (backend ``servers``, and its family's pool)."""
        return f"{SERVER_PREFIX}{self.index}"

    @property
    def address(self) -> str:
        """Where vLLM listens: loopback alone (the front door is the way in)."""
        return f"127.0.0.1:{self.port}"

    def with_gpus(self, gpus) -> "Replica":
        return Replica(self.index, self.family, self.service, self.runtime, self.base_port, tuple(gpus))


def replica(v: dict, index: int, family: str = DEFAULT_FAMILY, gpus=()) -> Replica:
    return Replica(int(index), family, family_service(v, family), runtime(v), base_port(v), tuple(gpus))


def families() -> list[str]:
    """Every family of the catalog, DiffusionGemma first."""
    return sorted(catalog.models()["families"], key=lambda f: f != DEFAULT_FAMILY)


def from_container(v: dict, name: str) -> Replica | None:
    """The replica a container name is (any family of the catalog), or None."""
    for family in families():
        match = re.fullmatch(re.escape(family_service(v, family)) + r"(?:-([1-9][0-9]*))?", name)
        if match:
            return replica(v, int(match.group(1) or 0), family)
    return None


def from_unit(v: dict, unit: str) -> Replica | None:
    """The replica a unit (name or path) runs, or None when it is none of ours."""
    name = unit.rsplit("/", 1)[-1]
    prefix = f"{runtime(v)}-"
    if not (name.startswith(prefix) and name.endswith(".service")):
        return None
    return from_container(v, name[len(prefix):-len(".service")])


def server_index(name: str) -> int | None:
    """The index of the replica a front door's server name is, or None (another server)."""
    match = re.fullmatch(re.escape(SERVER_PREFIX) + r"([0-9]+)", name or "")
    return int(match.group(1)) if match else None


def unit_globs(v: dict) -> tuple[str, ...]:
    """The unit files of every replica a host may have, each family's (a unit's name is
    schema-checked: no pattern character in it)."""
    return name_globs(v, f"{UNIT_DIR}/{runtime(v)}-", ".service")


def name_globs(v: dict, before: str, after: str) -> tuple[str, ...]:
    """Globs of the files named after each replica's container: ``before NAME after``."""
    return tuple(glob for family in families() for glob in
                 (f"{before}{family_service(v, family)}{after}", f"{before}{family_service(v, family)}-[0-9]*{after}"))


def units_of(v: dict, units: dict | None) -> list[tuple[Replica, dict]]:
    """(the replica, its unit's state) of every replica unit the host has, from the UnitFiles
    fact of `unit_globs` (a unit systemd does not know is not installed), by index."""
    found = []
    for path, unit in (units or {}).items():
        ident = from_unit(v, path)
        state = (unit or {}).get("state") or {}
        if ident is not None and state.get("LoadState") not in (None, "not-found"):
            found.append((ident, state))
    return sorted(found, key=lambda pair: (pair[0].index, pair[0].unit))


def installed(v: dict, units: dict | None) -> dict[int, tuple[Replica, dict]]:
    """Index -> (the replica, its unit's state) for every replica the host has. Two units of
    one index (a move to a family's name cut short): the one that runs."""
    found: dict[int, tuple[Replica, dict]] = {}
    for ident, state in units_of(v, units):
        if ident.index not in found or state.get("ActiveState") == "active":
            found[ident.index] = (ident, state)
    return found


def unit_fact(units: dict | None, ident: Replica) -> dict:
    """A replica's entry of the UnitFiles fact: {"file": FileState, "state": UnitState} (empty: none)."""
    return (units or {}).get(ident.unit_path) or {}


def chosen(indices, wanted: int | None) -> list[int]:
    """The replicas a day-2 command acts on: all of them, or the one ``--replica`` names."""
    return [i for i in indices if wanted is None or i == wanted]


# the table's reader for host-side programs, a library they start with
# what a host program that is handed the table includes to read it (its functions: serving/files/replicas.sh)
TABLE_READER = (NAME_VALUE_TABLE, Path(__file__).parent / "files" / "replicas.sh")
# the replica table's fields, each a NAME=VALUE word of a replica's line (serving/files/replicas.sh reads
# them by name): what host-side programs know of a replica
TABLE_FIELDS = ("index", "unit", "container", "port", "server", "gpus")


def _table_values(r: Replica) -> dict:
    return {"index": r.index, "unit": r.unit, "container": r.container, "port": r.port, "server": r.server,
            "gpus": ",".join(sorted(r.gpus))}


def shell_table(replicas) -> str:
    """The replicas as a table for host-side programs, a parameter of theirs: a line each, its
    fields NAME=VALUE words (`TABLE_FIELDS`; gpus comma-separated, empty when not known). The
    names come from here, never made again in shell; serving/files/replicas.sh reads them."""
    lines = []
    for r in replicas:
        values = {name: str(value) for name, value in _table_values(r).items()}
        bad = [name for name, value in values.items() if any(c.isspace() or c == "=" for c in value)]
        if bad:  # the names are schema-checked; a blank would split a word on the host
            raise ValueError(f"replica {r.index}: {', '.join(bad)} holds a blank or '=': {values}")
        lines.append(" ".join(f"{name}={values[name]}" for name in TABLE_FIELDS))
    return "\n".join(lines)


def read_table(text: str) -> list[dict]:
    """A table `shell_table` wrote: a dict of its fields for each replica line."""
    rows = []
    for line in text.splitlines():
        if line.strip():
            rows.append(dict(word.split("=", 1) for word in line.split()))
    return rows


@dataclass(frozen=True)
class Served:
    """What one replica runs: a model of its family, a memory fraction, its tensor-parallel
    size and the serving settings its family's ``models:`` entry sets for it alone."""
    replica: Replica
    model: str
    utilization: float
    tensor_parallel_size: int = 1
    settings: tuple = ()  # (name, value) pairs over the host's variables

    @classmethod
    def of(cls, v: dict, placed) -> "Served":
        """From a placement's replica (roles/preflight/placement.Placed)."""
        return cls(replica(v, placed.index, placed.family, [g["uuid"] for g in placed.gpus]), placed.model,
                   placed.utilization, placed.tensor_parallel_size,
                   tuple((k, tuple(x) if isinstance(x, list) else x) for k, x in sorted(placed.settings.items())))

    @property
    def index(self) -> int:
        return self.replica.index

    @property
    def family(self) -> str:
        return self.replica.family

    @property
    def gpus(self) -> tuple:
        return self.replica.gpus

    def variables(self, v: dict) -> dict:
        """The host's variables with this replica's own settings over them."""
        return {**v, **{k: list(x) if isinstance(x, tuple) else x for k, x in self.settings}}
