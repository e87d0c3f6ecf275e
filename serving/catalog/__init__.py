"""The image and model catalogs (``images.yml``, ``models.yml`` beside this file):
data, not code, checked against ``catalog.schema.yml`` when read. Shared by every role
that names an image or a model family; it imports no role."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

from converge import yamlsrc
from converge.errors import InventoryError
from converge.inventory import VarSource, yaml_problem
from converge.validate import check_source

HERE = Path(__file__).parent
DEFAULT_FAMILY = "diffusiongemma"  # what a host serves when its inventory declares no models


@lru_cache(maxsize=None)
def _load(name: str) -> dict:
    """A catalog, or InventoryError naming file:line: key for each problem."""
    path = HERE / f"{name}.yml"
    try:
        sourced = yamlsrc.load(path)
    except yaml.YAMLError as exc:
        raise InventoryError([yaml_problem(str(path), exc)]) from None
    except yamlsrc.InputError as exc:
        raise InventoryError([f"{path}:{exc.line or 1}: {exc.message}"]) from None
    except OSError as exc:
        raise InventoryError([f"{path}: cannot read: {exc.strerror}"]) from None
    schema = yamlsrc.load(HERE / "catalog.schema.yml").data[name]
    data = sourced.data if isinstance(sourced.data, dict) else {}
    problems = check_source(jsonschema.Draft202012Validator(schema), schema,
                            VarSource(f"catalog {name}", data, {}, sourced=sourced))
    if not isinstance(sourced.data, dict):
        problems.insert(0, f"{path}:1: expected a mapping")
    for error in jsonschema.Draft202012Validator(schema).iter_errors(data):
        if error.validator == "required":  # check_source leaves missing keys to the merged host vars
            problems.append(f"{path}:{sourced.line_of(tuple(error.absolute_path))}: {error.message}")
    if problems:
        raise InventoryError(problems)
    return sourced.data


def images() -> dict:
    return _load("images")


def models() -> dict:
    return _load("models")


def image_ref(v: dict, entry: dict, override: str | None = None) -> str:
    """An official image: ``override`` (the inventory's), or the catalog's ``entry``
    (``registry``, Docker Hub when absent; ``repository``; ``tag``), through the inventory's
    ``registry:`` mirror when the image is Docker Hub's."""
    ref = override or f"{entry.get('registry', 'docker.io')}/{entry['repository']}:{entry['tag']}"
    registry = v.get("registry")
    if registry and ref.startswith("docker.io/"):
        ref = f"{registry.rstrip('/')}/{ref.removeprefix('docker.io/')}"
    return ref


def monitoring_image(v: dict, name: str) -> str:
    """One of the monitoring stack's images (catalog ``monitoring.<name>``, or ``<name>_image``)."""
    return image_ref(v, images()["monitoring"][name], v.get(f"{name}_image"))


def problems() -> list[str]:
    """Every problem of both catalogs (for inventory.check), empty when they are sound."""
    found = []
    for name in ("images", "models"):
        try:
            _load(name)
        except InventoryError as exc:
            found += exc.problems
    return found
