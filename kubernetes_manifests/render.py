"""The fleet for Kubernetes: every file ``invoke render --target kubernetes`` writes, each
checked against the real schemas before anything is written. Pure but for ``write``."""
from __future__ import annotations

import copy
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from serving.key_limits import Limits

from . import checks, gateway, hardware, monitoring, pods
from .serving import ServingHost
from .values import SECRETS, stack_values

DEFAULTS = {"namespace": "dgemma", "release": "dgemma", "gateway": "dgemma-gateway"}


class RenderError(Exception):
    def __init__(self, problems: list[str]):
        super().__init__("\n".join(problems))
        self.problems = problems


@dataclass
class Settings:
    namespace: str = DEFAULTS["namespace"]
    release: str = DEFAULTS["release"]
    gateway: str = DEFAULTS["gateway"]
    values: dict = field(default_factory=dict)  # the inventory's kubernetes.values
    where: str = "kubernetes.values"  # where they were set (file:line), for errors
    hostnames: tuple = ()  # the names clients reach the Gateway by (its certificate's)
    tls_files: tuple = ()  # (certificate, key) of the Gateway on the control machine, the fleet CA's

    @classmethod
    def of(cls, v: dict, where: str = "") -> "Settings":
        k = v.get("kubernetes") or {}
        return cls(k.get("namespace", DEFAULTS["namespace"]), k.get("release", DEFAULTS["release"]),
                   k.get("gateway", DEFAULTS["gateway"]), copy.deepcopy(k.get("values") or {}),
                   f"{where}: kubernetes.values" if where else "kubernetes.values", tuple(k.get("hostnames") or ()))

    def certificate_names(self) -> list[str]:
        """What the Gateway's certificate names: the inventory's hostnames, else the Gateway's own name."""
        return list(self.hostnames) or [self.gateway]


def _yaml(docs: list[dict]) -> str:
    return "".join("---\n" + yaml.safe_dump(d, sort_keys=False, width=120) for d in docs)


def render(hosts: list[ServingHost], keys: dict[str, Limits], settings: Settings, v: dict) -> dict[str, str]:
    """{relative path: text}, or RenderError naming each problem (the host, or the file and key)."""
    if not hosts:
        raise RenderError(["no serving host to render: the inventory's hosts serve nothing (models:)"])
    try:
        values, named = stack_values(hosts, settings.release)
    except hardware.HardwareError as exc:
        raise RenderError([str(exc)]) from None
    problems = checks.values_problems(settings.values, settings.where) if settings.values else []
    values = checks.merged(values, settings.values)
    problems += checks.values_problems(values, "values.yaml")
    ns, release = settings.namespace, settings.release
    files: dict[str, list[dict]] = {}
    in_force = checks.merged(checks.chart_defaults(), values)  # what the chart's templates read
    for spec in values["servingEngineSpec"]["modelSpec"]:
        files[f"serving/{spec['name']}.yaml"] = pods.deployment(in_force, spec, release, ns)
    families = sorted({g.family for _, g in named})
    files["gateway/gateway.yaml"] = gateway.listener(release, ns, settings.gateway)
    files["gateway/policies.yaml"] = gateway.policies(keys, release, ns, settings.gateway, families)
    files["monitoring/servicemonitor.yaml"] = [monitoring.service_monitor(release, ns)]
    files["monitoring/prometheusrule.yaml"] = [monitoring.rules(v, release, ns)]
    files["monitoring/dashboards.yaml"] = monitoring.dashboard_maps(release, ns)
    for path, docs in files.items():
        for i, doc in enumerate(docs):
            problems += checks.document_problems(doc, f"{path} #{i + 1} ({doc.get('kind')} "
                                                      f"{(doc.get('metadata') or {}).get('name')})")
    problems += checks.reference_problems(files, gateway.made_by_steps(release))
    if problems:
        raise RenderError(problems)
    out = {"values.yaml": "# production-stack (vllm-stack " + checks.chart_version() + ") values: "
                          "helm install " + release + " vllm/vllm-stack -f values.yaml\n"
                          + yaml.safe_dump(values, sort_keys=False, width=120)}
    out.update({path: _yaml(docs) for path, docs in files.items()})
    out["README.md"] = readme(named, keys, settings)
    return out


def readme(named: list, keys: dict[str, Limits], s: Settings) -> str:
    ns, release = s.namespace, s.release
    rows = "\n".join(f"| {name} | {g.model} | {g.image} | {dict(g.labels)[hardware.PRODUCT]} | {len(g.hosts)} | "
                     f"{', '.join(sorted({h for h, _ in g.hosts}))} |" for name, g in named)
    key_names = ", ".join(sorted(k for k in keys if k != "api_key_file")) or "(none yet: invoke keys.add NAME)"
    cert, key = s.tls_files or ("GATEWAY_CERT_FILE", "GATEWAY_KEY_FILE")
    eg, ai = gateway.ENVOY_GATEWAY, gateway.AI_GATEWAY
    ai_files = f"https://raw.githubusercontent.com/envoyproxy/ai-gateway/{ai}"
    return f"""# The fleet for Kubernetes

Rendered by `invoke render --target kubernetes` from the inventory and its hosts' facts: the same
choices the SSH deploy makes (image tag by arch and driver CUDA, variant and memory fraction by GPU,
the diffusion settings, replicas per GPU), each checked against the projects' own schemas
(kubernetes_manifests/schemas/SOURCES.md names them, at pinned commits).

## Install

First Envoy Gateway {eg} (its chart installs the Gateway API's CRDs, v1.6.1) with Envoy AI Gateway {ai}'s
values and its rate-limit addon, the Redis its global rate limits count in, then Envoy AI Gateway {ai}:
the releases whose CRDs these files are checked against.

    kubectl apply -f {ai_files}/examples/token_ratelimit/redis.yaml
    helm upgrade -i eg oci://docker.io/envoyproxy/gateway-helm --version {eg} \\
        -n envoy-gateway-system --create-namespace \\
        -f {ai_files}/manifests/envoy-gateway-values.yaml \\
        -f {ai_files}/examples/token_ratelimit/envoy-gateway-values-addon.yaml
    kubectl wait --timeout=2m -n envoy-gateway-system deployment/envoy-gateway --for=condition=Available
    helm upgrade -i aieg-crd oci://docker.io/envoyproxy/ai-gateway-crds-helm --version {ai} \\
        -n envoy-ai-gateway-system --create-namespace
    helm upgrade -i aieg oci://docker.io/envoyproxy/ai-gateway-helm --version {ai} \\
        -n envoy-ai-gateway-system --create-namespace
    kubectl wait --timeout=2m -n envoy-ai-gateway-system deployment/ai-gateway-controller --for=condition=Available

Then the fleet: its namespace, its Secrets, production-stack's chart, the Gateway and its route.
The Gateway's certificate is the fleet CA's, for {', '.join(s.certificate_names())} (the inventory's
`kubernetes.hostnames`: the names your clients use), kept with the fleet's credentials on this
machine (`invoke render --target kubernetes --gateway-certificate` makes it{', and has' if s.tls_files else ''});
clients trust the fleet CA as they do at the fleet's gateways. Your own certificate for those names
does as well.

    kubectl create namespace {ns}
    kubectl -n {ns} create secret tls {gateway.tls_secret(release)} --cert={cert} --key={key}
    kubectl -n {ns} create secret generic {SECRETS['hf_token'][0]} --from-file={SECRETS['hf_token'][1]}=HF_TOKEN_FILE
    kubectl -n {ns} create secret generic {SECRETS['vllm_api_key'][0]} --from-file={SECRETS['vllm_api_key'][1]}=API_KEY_FILE
    kubectl -n {ns} create secret generic {gateway.KEYS_SECRET} --from-literal=NAME=KEY ...   # one per key
    helm repo add vllm https://vllm-project.github.io/production-stack
    helm install {release} vllm/vllm-stack -n {ns} -f values.yaml
    kubectl apply -f gateway/ -f monitoring/
    kubectl -n {ns} wait --timeout=5m gateway/{s.gateway} --for=condition=Programmed

The Gateway's address, and a chat through it (the CA file is `invoke endpoints`' `ca_file`):

    ADDRESS=$(kubectl -n {ns} get gateway {s.gateway} -o jsonpath='{{.status.addresses[0].value}}')
    curl --cacert CA_FILE --resolve {s.certificate_names()[0]}:443:$ADDRESS https://{s.certificate_names()[0]}/v1/chat/completions \\
        -H "Authorization: Bearer KEY" -H "Content-Type: application/json" \\
        -d '{{"model": "diffusiongemma", "messages": [{{"role": "user", "content": "Say OK."}}]}}'

`serving/` holds each model spec's Deployment as the chart renders it (for a cluster without Helm,
and what the lab runs with `podman kube play`): apply it instead of the chart's engines, not with them.

The nodes need NVIDIA's GPU Operator (or its device plugin and GPU Feature Discovery): the specs
are placed by GFD's labels (`nvidia.com/gpu.product`, `nvidia.com/gpu.memory`,
`nvidia.com/cuda.runtime-version.major`/`.minor`, `kubernetes.io/arch`), not by host names, but
where hosts of one hardware are set up apart (their inventory variables differ).

## Model specs

| spec | model | image | GPU | replicas | the SSH fleet's hosts |
|---|---|---|---|---|---|
{rows}

## Keys

Envoy Gateway checks the keys (SecurityPolicy `apiKeyAuth`, Secret `{gateway.KEYS_SECRET}`, whose entries are
the key names: {key_names}). The toolkit keeps only their sha256: give each entry the key its owner
holds (or make new ones). Requests a minute and tokens a day per key (a front end's people apart)
are BackendTrafficPolicy rate limits; the tokens are vLLM's usage, counted by the AIGatewayRoute.

## What does not carry over, and what takes its place

| the SSH fleet | in Kubernetes |
|---|---|
| the rolling gate (one replica at a time, drained, no failed request) | the Deployment's rolling update with the readiness probe on /health |
| weights pre-pulled into each host's cache before the unit starts | vLLM fetches them into the spec's volume (pvcStorage) on its first start: HF_TOKEN from the Secret |
| requests at once per key, the models a key may use, expiry | no Envoy rate limit counts requests in flight; models: an Envoy `authorization` rule on `x-ai-eg-model`; expiry: remove the key's entry from the Secret |
| a day's tokens reserved before an answer | Envoy counts the tokens when the answer ends (the request that crosses the budget is answered) |
| the gateways' shared address (keepalived), the TLS front doors | the Gateway's Service (a LoadBalancer) and its TLS listener |
| `invoke top`, `status`, `logs`, `recover` over SSH | `kubectl get/logs/describe`, Grafana's dashboards (ConfigMaps here) |
| the host exporters' alerts (GPU memory, weights disk, certificates, units) | DCGM exporter's and kube-prometheus-stack's own alerts; the PrometheusRule here keeps the ones that read vLLM's metrics |
| `--enable-prefix-caching` left to vLLM's default | the chart always passes it or its opposite: the specs ask for it on, vLLM's default |
"""


def write(files: dict[str, str], out: Path) -> list[Path]:
    """Each file written whole (a temporary file renamed over it)."""
    written = []
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
        written.append(path)
    return written
