"""Prometheus's configuration for the fleet, and what it scrapes. Pure.

Every serving host and gateway is scraped through its front door (https, the fleet CA,
the monitoring key): its HAProxy exporter and node exporter are known from the inventory
(file_sd: a host that is down is still a target, whose ``up`` is 0); its replicas and a
DCGM exporter are found by asking the host itself (http_sd: ``/metrics/sd``, written by
the deploy that placed them), so a replica placed or dropped by a deploy of that host
alone is scraped, or not, within a refresh, with no change here."""
from __future__ import annotations

import json

import yaml

from serving import scrape_targets
from serving.fleet import is_exporting

CONTAINER_DIR = "/etc/prometheus"  # where the official image reads its configuration
KEY_FILE = "monitoring.key"
CA_FILE = "ca.crt"
RULES_FILE = "rules/dgemma.yml"
TARGETS_FILE = "targets/hosts.json"
SD_REFRESH = "30s"


def front_doors(fleet) -> list[tuple[str, dict, bool]]:
    """(host, its address as the inventory gives it, is it a gateway) for every host scraped
    through its front door, and for every gateway (a host that serves and is a gateway: twice,
    each at its own port)."""
    return ([(d.host, {"ansible_host": d.address, "api_port": d.port}, False) for d in fleet.serving]
            + [(d.host, {"ansible_host": d.address, "api_port": d.port}, True) for d in fleet.gateways])


def static_targets(fleet) -> list[dict]:
    """Each host's HAProxy and node exporter (file_sd), from the inventory; a gateway that serves
    too has its node exporter scraped once, through its front door."""
    serving = {d.host for d in fleet.serving}
    return [g for host, v, gateway in front_doors(fleet)
            for g in scrape_targets.host_targets(host, v, [], gateway=gateway,
                                                 node=not (gateway and host in serving))]


def render_targets(fleet) -> str:
    return scrape_targets.render(static_targets(fleet))


def _secured(files: str) -> dict:
    """How a scrape reaches a front door: https, the fleet CA, the monitoring key."""
    return {"scheme": "https", "authorization": {"type": "Bearer", "credentials_file": f"{files}/{KEY_FILE}"},
            "tls_config": {"ca_file": f"{files}/{CA_FILE}"}}


# DCGM's label for a GPU's uuid, copied to the name the replicas' series carry (gpu_uuid)
GPU_UUID_RELABEL = [{"source_labels": ["UUID"], "regex": "(.+)", "target_label": "gpu_uuid"}]


def render(host: str, v: dict, fleet, remote_write_files: list[dict], files: str = CONTAINER_DIR) -> str:
    """prometheus.yml; ``remote_write_files``: for each of prometheus_remote_write, where its
    secrets are on the host (``bearer_token`` or ``password``: a path under ``files``)."""
    secured = _secured(files)
    sd = [{"url": f"https://{scrape_targets.address(h, hv)}{scrape_targets.SD_PATH}", "refresh_interval": SD_REFRESH,
           "authorization": secured["authorization"], "tls_config": secured["tls_config"]}
          for h, hv, gateway in front_doors(fleet) if not gateway]
    local = [{"targets": [f"127.0.0.1:{int(v.get('prometheus_port', 9090))}"],
              "labels": {"job": "prometheus", "host": host, "instance": host}},
             {"targets": [f"127.0.0.1:{int(v.get('alertmanager_port', 9093))}"],
              "labels": {"job": "alertmanager", "host": host, "instance": host}}]
    # a monitoring host that serves or is a gateway has its node exporter scraped through its front door
    if v.get("node_exporter_managed", True) and not is_exporting(v):
        local.append({"targets": [f"127.0.0.1:{int(v.get('node_exporter_port', scrape_targets.NODE_EXPORTER_PORT))}"],
                      "labels": {"job": scrape_targets.NODE_JOB, "host": host, "instance": host}})
    config = {
        "global": {"scrape_interval": f"{int(v.get('scrape_interval_s', 15))}s",
                   "scrape_timeout": f"{min(10, int(v.get('scrape_interval_s', 15)))}s",
                   "evaluation_interval": f"{int(v.get('evaluation_interval_s', 15))}s",
                   "external_labels": {"monitor": host}},
        "rule_files": [f"{files}/{RULES_FILE}"],
        "alerting": {"alertmanagers": [{"static_configs": [
            {"targets": [f"127.0.0.1:{int(v.get('alertmanager_port', 9093))}"]}]}]},
        "scrape_configs": [
            # each host's HAProxy and node exporter: from the inventory
            {"job_name": "fleet-hosts", **secured, "file_sd_configs": [{"files": [f"{files}/{TARGETS_FILE}"]}],
             "metric_relabel_configs": GPU_UUID_RELABEL},
            # its replicas (and a DCGM exporter): from the host itself; the rest of its list is above
            {"job_name": "fleet-replicas", **secured, "http_sd_configs": sd,
             "relabel_configs": [{"source_labels": ["job"], "regex": f"{scrape_targets.VLLM_JOB}|{scrape_targets.GPU_JOB}",
                                  "action": "keep"}],
             "metric_relabel_configs": GPU_UUID_RELABEL},
            {"job_name": "monitoring", "static_configs": local}],
    }
    if not sd:
        config["scrape_configs"].pop(1)
    if remote_write_files:
        config["remote_write"] = [_remote_write(r) for r in remote_write_files]
    header = ("# Managed by dgemma-fleet (roles/monitoring): edits here are replaced on the next deploy.\n"
              f"# Prometheus on {host}: the fleet's hosts through their front doors (serving/scrape_targets.py).\n")
    return header + yaml.safe_dump(config, sort_keys=False, default_flow_style=False, width=1000)


def _remote_write(r: dict) -> dict:
    out = {"url": r["url"]}
    if r.get("bearer_token"):
        out["authorization"] = {"type": "Bearer", "credentials_file": r["bearer_token"]}
    if r.get("password"):
        out["basic_auth"] = {"username": r["username"], "password_file": r["password"]}
    return out


def file_sd(groups_by_host: dict[str, list[dict]]) -> str:
    """Every host's target groups as one file_sd file (``invoke render --format prometheus``)."""
    return json.dumps([g for groups in groups_by_host.values() for g in groups], indent=2, sort_keys=True) + "\n"
