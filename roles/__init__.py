"""The roles that put DiffusionGemma on a host, in the order they run.

Each role folder holds ``defaults/main.yml``, ``schema.yml`` (JSON Schema of its
variables, like Ansible's meta/argument_specs), its templates, ``role.py`` (facts
in, steps out; no SSH here) and ``tests/`` (its testinfra checks).
"""
from __future__ import annotations

import copy
import importlib
from functools import lru_cache
from pathlib import Path

import yaml

from converge import yamlsrc
from converge.inventory import VarSource

HERE = Path(__file__).parent
# the product's names, which the engine takes from its caller
LOCK_NAME = "dgemma"  # /run/lock/dgemma.lock on every host
INVENTORY_VARIABLE = "DGEMMA_INVENTORY"  # the inventory folder when --inventory is not given
PROGRESS_VARIABLE = "DGEMMA_PROGRESS_S"  # seconds between plain progress lines off a terminal
# weights before service: the unit names the model only once its weights are whole
ORDER = ["preflight", "image", "weights", "service", "start", "frontdoor", "gateway", "shared_address", "exporters",
         "monitoring"]


def advisory(hostvars: dict) -> bool:
    """A host off the serving path (a monitoring host that is neither a gateway nor a serving
    host): a run reports its failures and does not fail for them, so that Prometheus down
    never fails a deploy of the hosts that serve."""
    from serving.fleet import is_gateway, is_monitoring, is_serving
    return is_monitoring(hostvars) and not is_gateway(hostvars) and not is_serving(hostvars)


def load(names=None):
    return [importlib.import_module(f"roles.{n}.role").ROLE for n in (names or ORDER)]


@lru_cache(maxsize=None)
def schemas() -> tuple:
    return tuple(yaml.safe_load((HERE / n / "schema.yml").read_text()) for n in ORDER)


@lru_cache(maxsize=None)
def _role_defaults(name: str) -> yamlsrc.Sourced:
    # read once a process: the roles' own files (a long-lived caller, the tests, asks again and again)
    return yamlsrc.load(HERE / name / "defaults" / "main.yml")


def defaults() -> list[VarSource]:
    out = []
    for name in ORDER:
        sourced = _role_defaults(name)
        # a copy of the values: whoever merges them gets its own
        out.append(VarSource(f"role defaults {name}", copy.deepcopy(sourced.data or {}), {}, sourced=sourced))
    return out


def problems() -> list[str]:
    """What is wrong with the roles' own data (the catalogs), for inventory.check."""
    from serving import catalog
    return catalog.problems()
