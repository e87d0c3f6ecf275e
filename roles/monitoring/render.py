"""`invoke render --format prometheus`: for those who run a Prometheus of their own, what
ours is given: the scrape configuration, every host's targets as file_sd reads them (each
host's replicas as this run's facts place them), the rules, and where the credentials are
(paths only: the monitoring key and the fleet CA stay on this machine until copied).
Changes nothing."""
from __future__ import annotations

import yaml

from converge.changes import Role
from converge.facts.nvidia import Dcgm
from credentials import directory
from credentials.ca import ca_paths

from serving import scrape_targets
from serving.fleet import is_exporting, is_gateway, is_serving
from serving.haproxy import tls
from serving.handoffs import CHOICE
from serving.replicas import Served

from . import prometheus, rules

# where the files go on the user's Prometheus host (the scrape configuration names them)
TARGET_DIR = "/etc/prometheus/dgemma"


def _summary(ctx) -> dict:
    v = ctx.vars
    gateway = scrape_targets.host_targets(ctx.name, v, [], gateway=True, node=not is_serving(v)) \
        if is_gateway(v) else []
    if not is_serving(v):
        return {"scrape_targets": gateway}
    choice = ctx.results.get(CHOICE)
    if choice is None:
        return {}  # the preflight choice failed: the report says why
    served = [Served.of(v, placed) for placed in choice.replicas]
    dcgm = scrape_targets.uses_dcgm(v, ctx.facts.get("dcgm") if ctx.facts else None)
    return {"scrape_targets": scrape_targets.host_targets(ctx.name, v, served, dcgm=dcgm) + gateway}


RENDER_ROLE = Role("render prometheus", lambda v: {"dcgm": Dcgm()}, lambda ctx: iter(()), summary=_summary,
                   hosts=is_exporting)


def files(groups_by_host: dict[str, list[dict]], v: dict) -> list[tuple[str, str]]:
    """(name, text) of each file to give a Prometheus: the scrape configuration to merge
    into its prometheus.yml, the targets, the rules, and the credentials' whereabouts."""
    folder = directory(v)
    key = folder / f"{tls.MONITORING_KEY}.key"
    made = "" if key.exists() else " (not made yet: the first deploy makes it)"
    secured = {"scheme": "https",
               "authorization": {"type": "Bearer", "credentials_file": f"{TARGET_DIR}/{prometheus.KEY_FILE}"},
               "tls_config": {"ca_file": f"{TARGET_DIR}/{prometheus.CA_FILE}"}}
    scrape = {"rule_files": [f"{TARGET_DIR}/rules.yml"],
              "scrape_configs": [{"job_name": "dgemma-fleet", **secured,
                                  "file_sd_configs": [{"files": [f"{TARGET_DIR}/targets.json"]}],
                                  "metric_relabel_configs": prometheus.GPU_UUID_RELABEL}]}
    remote = v.get("prometheus_remote_write") or []
    if remote:
        scrape["remote_write"] = [{"url": r["url"]} for r in remote]
    credentials = (
        f"# The monitoring key: {key}{made} (0600). Copy it to {TARGET_DIR}/{prometheus.KEY_FILE} on your\n"
        f"# Prometheus host, readable by Prometheus alone; the front doors hold its sha256 (deploy puts it\n"
        f"# there), and no user key opens /metrics/*.\n"
        f"# The fleet CA: {ca_paths(folder)[0]}. Copy it to {TARGET_DIR}/{prometheus.CA_FILE}.\n"
        f"# Each target is a host's front door (or gateway), https on its ansible_host: Prometheus must reach\n"
        f"# the hosts' networks (those behind a bastion too). Re-run this after a deploy that places replicas\n"
        f"# anew, or scrape each serving host's https://HOST:PORT{scrape_targets.SD_PATH} with http_sd_configs.\n"
        + ("# remote_write: add each endpoint's credentials (prometheus_remote_write in the inventory names\n"
           "# their files on this machine).\n" if remote else ""))
    return [("prometheus.yml (merge into yours)",
             yaml.safe_dump(scrape, sort_keys=False, default_flow_style=False, width=1000)),
            (f"{TARGET_DIR}/targets.json", prometheus.file_sd(groups_by_host)),
            (f"{TARGET_DIR}/rules.yml", rules.render(v)),
            ("credentials", credentials)]
