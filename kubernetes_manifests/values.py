"""vLLM production-stack's values (chart ``vllm-stack``) for a fleet: one ``modelSpec`` per model
family and hardware class, each the replicas the SSH deploy places on hosts of that hardware,
started with the same ``vllm serve`` arguments (roles/service/serve.serve_args), placed by GPU
Feature Discovery labels. Pure."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from converge.facts.nvidia import cuda_tuple
from serving import catalog
from roles.preflight.select import image_channel
from roles.preflight.variants import version
from serving.replicas import Served
from roles.service.container import ENVIRONMENT
from serving.vllm_serve import serve_args

from . import hardware
from .serving import ServingHost

CONTAINER_PORT = 8000  # the chart's (servingEngineSpec.containerPort)
# the chart sets these from vllmConfig (or itself): taken out of extraArgs
CHART_FLAGS = {"--gpu-memory-utilization": ("gpuMemoryUtilization", float), "--max-num-seqs": ("maxNumSeqs", int),
               "--tensor-parallel-size": ("tensorParallelSize", int), "--max-model-len": ("maxModelLen", int)}
SECRETS = {"hf_token": ("dgemma-hf-token", "token"), "vllm_api_key": ("dgemma-vllm-api-key", "key")}


@dataclass(frozen=True)
class Group:
    """Replicas that one modelSpec declares: same family, hardware, image and arguments."""
    family: str
    labels: tuple  # GFD labels but the CUDA version and count: (key, value) pairs
    cuda_range: tuple | None  # the driver CUDA range the image tag is chosen for; None: the inventory's image
    image: str
    model: str
    args: tuple  # vllm serve's arguments but the port
    tensor_parallel_size: int
    hosts: tuple  # the inventory's hosts these replicas are on (host, GPU indices) per replica


def image_cuda_range(host: ServingHost, families: list[str]) -> tuple | None:
    """The driver CUDA versions for which the catalog picks this host's image tag: from its row's
    min_cuda up to the next better row's (the catalog's rows are in order of preference)."""
    if host.vars.get("image"):
        return None
    rows = [r for r in catalog.images()["channels"][image_channel(host.vars, families)] if r["arch"] == host.arch]
    have = cuda_tuple(host.cuda_version)
    for i, row in enumerate(rows):
        if have >= version(row["min_cuda"]):
            better = [version(r["min_cuda"]) for r in rows[:i]]
            return tuple(version(row["min_cuda"])[:2]), (tuple(min(better)[:2]) if better else None)
    return None


def groups(hosts: list[ServingHost]) -> list[Group]:
    found: dict[tuple, list] = {}
    for host in hosts:
        node = hardware.labels(host)
        families = list(dict.fromkeys(p.family for p in host.choice.replicas))
        cuda_range = image_cuda_range(host, families)
        fixed = tuple(sorted((k, v) for k, v in node.items()
                             if k not in (hardware.CUDA_MAJOR, hardware.CUDA_MINOR, "nvidia.com/gpu.count")))
        for placed in host.choice.replicas:
            served = Served.of(host.vars, placed)
            args = serve_args(served.variables(host.vars), placed.model, placed.utilization,
                              placed.tensor_parallel_size, CONTAINER_PORT, placed.family)
            key = (placed.family, fixed, cuda_range, host.choice.image, placed.model, tuple(args),
                   placed.tensor_parallel_size)
            found.setdefault(key, []).append((host.name, tuple(g["index"] for g in placed.gpus)))
    return [Group(*key, hosts=tuple(where)) for key, where in sorted(found.items(), key=lambda kv: repr(kv[0]))]


def _name(group: Group, taken: set) -> str:
    """A modelSpec's name: its family and GPU product, short enough for the chart's Service
    (``RELEASE-NAME-engine-service``, a DNS label of 63 at most)."""
    product = dict(group.labels)[hardware.PRODUCT].lower().removeprefix("nvidia-")
    base = re.sub(r"[^a-z0-9-]+", "-", f"{group.family}-{product}")[:34].strip("-")
    name, n = base, 2
    while name in taken:
        name, n = f"{base}-{n}", n + 1
    taken.add(name)
    return name


def split_args(args: tuple) -> tuple[dict, list, str]:
    """vllm serve's arguments as the chart takes them: (vllmConfig, extraArgs, modelRevision)."""
    config: dict = {}
    extra: list = []
    revision = ""
    rest = list(args[1:])  # the model is modelURL
    while rest:
        arg = rest.pop(0)
        if arg in ("--host", "--port"):
            rest.pop(0)  # the chart's: 0.0.0.0 and its container port
        elif arg in CHART_FLAGS:
            field, kind = CHART_FLAGS[arg]
            config[field] = kind(rest.pop(0))
        elif arg == "--revision":
            revision = rest.pop(0)
        elif arg == "--enable-chunked-prefill":
            config["enableChunkedPrefill"] = True
        else:
            extra.append(arg)
    # the chart passes --enable-prefix-caching or its opposite, always: vLLM's own default for a
    # generative model (the SSH deploy passes neither)
    config["enablePrefixCaching"] = True
    config["extraArgs"] = extra
    return config, extra, revision


def model_spec(group: Group, name: str, terms: list) -> dict:
    repository, _, tag = group.image.rpartition(":")
    config, _, revision = split_args(group.args)
    disk_mib = catalog.models()["variants"].get(group.model, {}).get("disk_mib", 50_000)
    replicas = len(group.hosts)
    spec = {
        "name": name,
        "repository": repository, "tag": tag,
        "modelURL": group.model,
        "replicaCount": replicas,
        "requestCPU": 4,
        # loading reads the checkpoint through host memory
        "requestMemory": f"{math.ceil(disk_mib / 1024) + 8}Gi",
        "requestGPU": group.tensor_parallel_size,
        "pvcStorage": f"{math.ceil(disk_mib * 1.2 / 1024)}Gi",
        # one volume of weights for every replica of the spec: shared when there are several
        "pvcAccessMode": ["ReadWriteOnce" if replicas == 1 else "ReadWriteMany"],
        "vllmConfig": config,
        # the image's settings as the SSH deploy's (roles/service/container.ENVIRONMENT), but offline:
        # here vLLM fetches the weights into the volume when it starts
        "env": [{"name": k, "value": v} for k, v in ENVIRONMENT.items() if k != "HF_HUB_OFFLINE"],
        "hf_token": {"secretName": SECRETS["hf_token"][0], "secretKey": SECRETS["hf_token"][1]},
        "nodeSelectorTerms": terms,
    }
    if revision:
        spec["modelRevision"] = revision
    return spec


def stack_values(hosts: list[ServingHost], release: str) -> tuple[dict, list[tuple[str, Group]]]:
    """(the chart's values, each modelSpec's name with the replicas it declares)."""
    found = groups(hosts)
    # hardware that more than one spec claims (hosts of one kind set up apart): each pinned to its hosts
    claims: dict[tuple, int] = {}
    for g in found:
        claims[(g.family, g.labels, g.cuda_range)] = claims.get((g.family, g.labels, g.cuda_range), 0) + 1
    specs, named, taken = [], [], set()
    for g in found:
        pinned = sorted({h for h, _ in g.hosts}) if claims[(g.family, g.labels, g.cuda_range)] > 1 else None
        terms = hardware.node_selector_terms(dict(g.labels), g.cuda_range, pinned)
        name = _name(g, taken)
        specs.append(model_spec(g, name, terms))
        named.append((name, g))
    values = {
        "servingEngineSpec": {
            "enableEngine": True,
            "labels": {"app.kubernetes.io/part-of": "dgemma-fleet"},
            "vllmApiKey": {"secretName": SECRETS["vllm_api_key"][0], "secretKey": SECRETS["vllm_api_key"][1]},
            "modelSpec": specs,
            # scraped through our ServiceMonitor (monitoring.py), with the labels the alerts read
            "serviceMonitor": {"enabled": False},
        },
        "routerSpec": {"enableRouter": True, "routingLogic": "roundrobin"},
    }
    return values, named
