"""The fleet's alerting rules, rendered with the inventory's thresholds. Pure."""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml

from serving.templates import environment

HERE = Path(__file__).parent


@lru_cache(maxsize=None)
def default_thresholds() -> dict:
    """The thresholds of defaults/main.yml: a key the inventory leaves out keeps its value
    (an inventory that sets one threshold replaces the whole mapping, as Ansible does)."""
    return dict(yaml.safe_load((HERE / "defaults" / "main.yml").read_text())["alert_thresholds"])


def thresholds(v: dict) -> dict:
    return {**default_thresholds(), **(v.get("alert_thresholds") or {})}


def render(v: dict) -> str:
    t = thresholds(v)
    # [[ ]] for our values: {{ }} is Prometheus's own template language in the annotations
    env = environment(HERE / "templates", variable_start_string="[[", variable_end_string="]]")
    return env.get_template("rules.yml.j2").render(t=t, waiting_range=f"[{int(t['waiting_seconds'])}s]")
