"""What the monitoring hosts scrape on one host, and where: every series of a serving host
or a gateway leaves it through its front door (TLS, and a key only the monitoring hosts
hold), under one path per source:

- ``/metrics/replica/N``: replica N's own vLLM ``/metrics`` (which stays on loopback);
- ``/metrics/haproxy``: the front door's (or gateway's) HAProxy exporter;
- ``/metrics/node``: the node exporter, with the GPU collector's textfiles (nvidia-smi);
- ``/metrics/gpu``: NVIDIA's DCGM exporter, on the hosts that have DCGM;
- ``/metrics/usage``: a gateway's usage service (requests and tokens per key and model);
- ``/metrics/sd``: this list itself, as Prometheus's HTTP service discovery reads it.

A host's targets are target groups in Prometheus's service-discovery form (http_sd and
file_sd read the same JSON), each naming its job and labelled with what it is: the host's
inventory name, and for a replica its index, model family, checkpoint and GPUs. Pure:
roles import this module, it imports no role."""
from __future__ import annotations

import json

from serving.fleet import api_port, frontdoor_port

SD_PATH = "/metrics/sd"
HAPROXY_PATH = "/metrics/haproxy"
NODE_PATH = "/metrics/node"
GPU_PATH = "/metrics/gpu"
USAGE_PATH = "/metrics/usage"
REPLICA_PREFIX = "/metrics/replica/"
# where the exporters listen on each host: loopback only, reached through the front door
NODE_EXPORTER_PORT = 9100
DCGM_EXPORTER_PORT = 9400

# the jobs, as the rules and dashboards name them
VLLM_JOB, FRONTDOOR_JOB, GATEWAY_JOB, NODE_JOB, GPU_JOB = "vllm", "frontdoor", "gateway", "node", "gpu"
USAGE_JOB = "usage"


def uses_dcgm(v: dict, dcgm_fact: dict | None) -> bool:
    """Whether the host's GPUs are read by NVIDIA's DCGM exporter (``gpu_metrics: dcgm``, or
    ``auto`` on a host whose DCGM host engine runs) rather than from nvidia-smi."""
    chosen = v.get("gpu_metrics", "auto")
    return chosen == "dcgm" or (chosen == "auto" and bool((dcgm_fact or {}).get("hostengine")))


def replica_path(index: int) -> str:
    return f"{REPLICA_PREFIX}{int(index)}"


def address(name: str, v: dict, gateway: bool = False) -> str:
    """Where the monitoring hosts reach this host's front door (or its gateway): its
    ansible_host (which its certificate names; else its inventory name) and the port."""
    host = str(v.get("ansible_host") or name)
    port = api_port(v) if gateway else frontdoor_port(v)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def host_targets(name: str, v: dict, served: list, *, gateway: bool = False, dcgm: bool = False,
                 node: bool = True) -> list[dict]:
    """The host's target groups, through its front door (or its gateway). ``served``: what each
    replica runs (serving.replicas.Served: its index, family, checkpoint and GPUs); a gateway has
    none. ``dcgm``: the host runs NVIDIA's DCGM exporter. ``node``: its node exporter is scraped
    here (not on a gateway that serves too: its front door has it, and a second scrape would
    write the same series twice)."""
    where = [address(name, v, gateway)]

    def group(job, path, **labels):
        return {"targets": where, "labels": {"job": job, "__metrics_path__": path, "host": name,
                                             "instance": labels.pop("instance", name), **labels}}

    out = [group(GATEWAY_JOB if gateway else FRONTDOOR_JOB, HAPROXY_PATH)] + ([group(NODE_JOB, NODE_PATH)] if node else [])
    if dcgm:
        out.append(group(GPU_JOB, GPU_PATH))
    if gateway:
        out.append(group(USAGE_JOB, USAGE_PATH))
    for s in sorted(served, key=lambda s: s.index):
        out.append(group(VLLM_JOB, replica_path(s.index), instance=f"{name}/{s.index}", replica=str(s.index),
                         model=s.family, variant=s.model, gpu_uuid=",".join(s.gpus)))
    return out


def render(groups: list[dict]) -> str:
    """The JSON a host serves at /metrics/sd (and file_sd reads): one group a line."""
    return "[\n" + ",\n".join(json.dumps(g, sort_keys=True) for g in groups) + "\n]\n"


def parse(text: str) -> list[dict]:
    """Target groups back from JSON (empty when the text is not a list of groups)."""
    try:
        groups = json.loads(text)
    except ValueError:
        return []
    return [g for g in groups if isinstance(g, dict) and isinstance(g.get("targets"), list)] \
        if isinstance(groups, list) else []


def replicas_of(groups: list[dict]) -> list[dict]:
    """The replicas a host's target groups name (index, family, model, gpus), as
    `host_targets` takes them."""
    out = []
    for g in groups:
        labels = g.get("labels") or {}
        if labels.get("job") == VLLM_JOB and str(labels.get("replica", "")).isdigit():
            out.append({"index": int(labels["replica"]), "family": labels.get("model", ""),
                        "model": labels.get("variant", ""),
                        "gpus": [u for u in str(labels.get("gpu_uuid", "")).split(",") if u]})
    return out
