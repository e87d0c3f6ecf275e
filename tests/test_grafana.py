"""The Grafana dashboards in the repository are what grafana/build.py writes, each panel with a
query, the three linked to each other; the provisioning files load as YAML. (Every panel's query
returning data is a lab test: tests/lab/test_lab_monitoring.py.)"""
import json

import yaml

from grafana import build
from tests.conftest import ROOT

GRAFANA = ROOT / "grafana"


def test_the_dashboards_are_what_build_writes():
    for name, text in build.render().items():
        assert (GRAFANA / "dashboards" / name).read_text() == text, f"run: python3 -m grafana.build ({name})"


def test_each_panel_queries_prometheus_and_the_dashboards_link_to_each_other():
    uids = set()
    for path in sorted((GRAFANA / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        uids.add(dashboard["uid"])
        assert dashboard["panels"] and all(p["targets"] and all(t["expr"].strip() for t in p["targets"])
                                           for p in dashboard["panels"]), path.name
        assert all(p["gridPos"]["x"] + p["gridPos"]["w"] <= 24 for p in dashboard["panels"])
        assert len(dashboard["links"]) == 2
        variables = {v["name"] for v in dashboard["templating"]["list"]}
        used = {v for p in dashboard["panels"] for t in p["targets"] for v in ("host", "replica")
                if f"${v}" in t["expr"]}
        assert used <= variables, (path.name, used - variables)
    assert uids == {"dgemma-fleet", "dgemma-host", "dgemma-replica"}
    for path in (GRAFANA / "provisioning").rglob("*.yml"):
        assert yaml.safe_load(path.read_text())["apiVersion"] == 1
