"""After a change to a proxy's template: the no-op cases' captured configuration (and
the generation the instance answers as), monitoring key and scrape targets made what
the roles now render, so that they stay no-ops. ``python -m tests.plans.refresh_noop``, then ``PLAN_CASES_WRITE=1``
for their steps; read the diff before committing."""
from __future__ import annotations

import hashlib
import json

from tests import plans

CASES = {"frontdoor/noop-rtx01.json": "frontdoor", "gateway/noop-gateway01.json": "gateway"}


# the proxy's files a template change moves: the step's name ends so, its fact is <prefix>_<name>
FILES = {"configuration": "config", "monitoring key (sha256)": "monitoring_keys", "scrape targets": "targets"}


def refresh(relative: str, prefix: str):
    path = plans.HERE / "cases" / relative
    raw = json.loads(path.read_text())
    for _ in range(3):  # the generation is in the configuration: once more after it moves
        wanted = [s for s in plans.plan(plans.load(path)) if s.get("needed")
                  and any(s.get("file", "").endswith(suffix) for suffix in FILES)]
        if not wanted:
            return
        for step in wanted:
            fact = next(f"{prefix}_{name}" for suffix, name in FILES.items() if step["file"].endswith(suffix))
            text = "\n".join(step["content"]) + "\n"
            owner, group = step["owner"].split(":")
            raw["facts_changes"][fact] = {"__replace__": True, "value": {
                "mode": step["mode"], "owner": owner, "group": group, "size": len(text.encode()),
                "sha256": hashlib.sha256(text.encode()).hexdigest(), "content": text}}
            if fact.endswith("_config"):
                generation = next(line for line in step["content"] if "X-Frontdoor-Generation" in line).split()[-1]
                raw["facts_changes"][f"{prefix}_served"] = {"__replace__": True, "value": generation}
        path.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"{relative}: {', '.join(s['file'] for s in wanted)}")


# the exporters' and the monitoring host's no-op cases: each needed step's fact as the step wants it
ROLE_FILES = {"placement textfile": "placement_textfile", "certificates textfile": "certificates_textfile",
              "metrics collector": "collector", "metrics collector unit": "collector_unit_file",
              "dgemma-node-exporter unit": "node_exporter_unit_file", "DCGM exporter fields": "dcgm_counters",
              "dgemma-dcgm-exporter unit": "dcgm_exporter_unit_file", "prometheus configuration": "prometheus_yml",
              "alerting rules": "prometheus_rules", "fleet CA certificate": "prometheus_ca",
              "monitoring key": "prometheus_key", "scrape targets": "prometheus_targets",
              "alertmanager configuration": "alertmanager_yml"}
RUNNING = {"metrics collector running": "collector_unit", "dgemma-node-exporter answering": "node_exporter_unit",
           "dgemma-dcgm-exporter answering": "dcgm_exporter_unit", "dgemma-prometheus answering": "prometheus_unit",
           "dgemma-alertmanager answering": "alertmanager_unit"}
ROLE_CASES = ["exporters/noop-rtx01.json", "exporters/noop-monitor01.json", "monitoring/noop-monitor01.json"]


def refresh_role(relative: str):
    """A no-op case of the exporters or monitoring role: its facts made what the role wants
    (files, units running and enabled, folders present, images pulled)."""
    path = plans.HERE / "cases" / relative
    raw = json.loads(path.read_text())
    changes = raw.setdefault("facts_changes", {})
    for _ in range(3):
        needed = [s for s in plans.plan(plans.load(path)) if s.get("needed")]
        if not needed:
            return
        for step in needed:
            name = step.get("file") or step.get("command")
            if step.get("file") in ROLE_FILES:
                owner, group = step["owner"].split(":")
                if step["file"] != "monitoring key":
                    text = "\n".join(step["content"]) + "\n"
                    value = {"mode": step["mode"], "owner": owner, "group": group, "size": len(text.encode()),
                             "sha256": hashlib.sha256(text.encode()).hexdigest(), "content": text}
                else:  # the monitoring key: the cases' own (tests/plans/credentials), known by its hash
                    secret = ((plans.HERE / "credentials" / "monitoring.key").read_text().strip() + "\n").encode()
                    value = {"mode": step["mode"], "owner": owner, "group": group, "size": len(secret),
                             "sha256": hashlib.sha256(secret).hexdigest()}
                changes[ROLE_FILES[step["file"]]] = {"__replace__": True, "value": value}
            elif name in RUNNING:
                changes[RUNNING[name]] = {"__replace__": True, "value": {
                    "LoadState": "loaded", "ActiveState": "active", "SubState": "running",
                    "UnitFileState": "enabled", "NRestarts": "0"}}
            elif name == "metrics folder":
                changes["textfiles_dir"] = {"__replace__": True, "value": True}
            elif name == "monitoring data folders":
                changes["prometheus_data"] = changes["alertmanager_data"] = {"__replace__": True, "value": True}
            elif name.startswith("pull "):
                ref = name.removeprefix("pull ")
                images = changes.get("images", {}).get("value") or \
                    json.loads((plans.HERE / "facts" / f"{raw['facts']}.json").read_text())["facts"]["images"]
                images = images + [{"arch": "amd64", "digests": [], "id": hashlib.sha256(ref.encode()).hexdigest(),
                                    "repo_digests": [], "tags": [ref]}]
                changes["images"] = {"__replace__": True, "value": images}
        path.write_text(json.dumps(raw, indent=1) + "\n")
        print(f"{relative}: {', '.join(s.get('file') or s.get('command') for s in needed)}")


if __name__ == "__main__":
    for case, kind in CASES.items():
        refresh(case, kind)
    for case in ROLE_CASES:
        refresh_role(case)
