"""The image and model catalogs (``images.yml``, ``models.yml`` beside this file)."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

HERE = Path(__file__).parent


@lru_cache(maxsize=None)
def images() -> dict:
    return yaml.safe_load((HERE / "images.yml").read_text())


@lru_cache(maxsize=None)
def models() -> dict:
    return yaml.safe_load((HERE / "models.yml").read_text())
