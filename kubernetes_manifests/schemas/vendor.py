"""Refresh the vendored schemas (SOURCES.md says where each came from, at which commit).

    python -m kubernetes_manifests.schemas.vendor MIRRORS_DIR KUBERNETES_VALIDATE_WHEEL

MIRRORS_DIR holds a git clone of each project as ``owner+name/repo`` (what the tool library's
``fetch`` makes); the wheel is kubernetes-validate's, whose schemas for the core kinds are
Kubernetes' own OpenAPI definitions. Each CRD's served version's openAPIV3Schema is kept as
it is; the core kinds' definitions are cut down to those the kinds we render reach."""
from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import yaml

HERE = Path(__file__).parent
CRDS = [  # (repository, path in it, the file written here[, the tag or commit: HEAD when left out])
    ("envoyproxy/gateway", "charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_securitypolicies.yaml",
     "securitypolicy.json"),
    ("envoyproxy/gateway",
     "charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_backendtrafficpolicies.yaml",
     "backendtrafficpolicy.json"),
    ("envoyproxy/gateway", "charts/gateway-helm/charts/crds/crds/generated/gateway.envoyproxy.io_backends.yaml",
     "backend.json"),
    ("envoyproxy/ai-gateway", "manifests/charts/ai-gateway-crds-helm/templates/aigateway.envoyproxy.io_aigatewayroutes.yaml",
     "aigatewayroute.json"),
    ("envoyproxy/ai-gateway",
     "manifests/charts/ai-gateway-crds-helm/templates/aigateway.envoyproxy.io_aiservicebackends.yaml",
     "aiservicebackend.json"),
    ("prometheus-operator/prometheus-operator", "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
     "prometheusrule.json"),
    ("prometheus-operator/prometheus-operator",
     "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml", "servicemonitor.json"),
    # the Gateway API's standard channel, at the release Envoy Gateway v1.9.0 is built on (its go.mod), whose
    # chart installs these CRDs (charts/gateway-helm/charts/crds/crds/gatewayapi-crds.yaml)
    ("kubernetes-sigs/gateway-api", "config/crd/standard/gateway.networking.k8s.io_gateways.yaml", "gateway.json",
     "v1.6.1"),
    ("kubernetes-sigs/gateway-api", "config/crd/standard/gateway.networking.k8s.io_gatewayclasses.yaml",
     "gatewayclass.json", "v1.6.1"),
]
CHART = ("vllm-project/production-stack", ["helm/values.schema.json", "helm/values.yaml", "helm/Chart.yaml"])
CORE_VERSION = "v1.33.0-local-strict"
CORE_KINDS = {"Deployment": "io.k8s.api.apps.v1.Deployment", "ConfigMap": "io.k8s.api.core.v1.ConfigMap",
              "Secret": "io.k8s.api.core.v1.Secret", "Service": "io.k8s.api.core.v1.Service",
              "PersistentVolumeClaim": "io.k8s.api.core.v1.PersistentVolumeClaim"}


def _git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


def _reached(definitions: dict, roots: list[str]) -> dict:
    keep, todo = {}, list(roots)
    while todo:
        name = todo.pop()
        if name in keep:
            continue
        keep[name] = definitions[name]
        text = json.dumps(keep[name])
        todo += [ref.split('"')[0] for ref in text.split('"$ref": "#/$defs/')[1:]]
    return keep


def vendor_crd(mirrors: Path, repo_name: str, path: str, out: str, ref: str = "HEAD") -> str:
    """One CRD's stored version's openAPIV3Schema, written to ``out``; its SOURCES.md row."""
    repo = mirrors / repo_name.replace("/", "+") / "repo"
    commit = _git(repo, "rev-parse", f"{ref}^{{commit}}").strip()
    crd = yaml.safe_load(_git(repo, "show", f"{commit}:{path}"))
    spec = crd["spec"]
    version = next(v for v in spec["versions"] if v.get("storage")) if len(spec["versions"]) > 1 else spec["versions"][0]
    kept = {"group": spec["group"], "kind": spec["names"]["kind"], "version": version["name"],
            "source": f"https://github.com/{repo_name}/blob/{commit}/{path}",
            "openAPIV3Schema": version["schema"]["openAPIV3Schema"]}
    (HERE / out).write_text(json.dumps(kept, separators=(",", ":"), sort_keys=True) + "\n")
    return f"| {out} | {repo_name}{'' if ref == 'HEAD' else ' ' + ref} | {commit} | {path} |"


def main(mirrors: Path, wheel: Path):
    sources = ["# Where each vendored schema came from", "",
               "Refreshed by `python -m kubernetes_manifests.schemas.vendor MIRRORS WHEEL`.", "",
               "| file | project | commit | path |", "|---|---|---|---|"]
    for entry in CRDS:
        sources.append(vendor_crd(mirrors, *entry))
    repo = mirrors / CHART[0].replace("/", "+") / "repo"
    commit = _git(repo, "rev-parse", "HEAD").strip()
    chart = HERE / "vllm-stack"
    chart.mkdir(exist_ok=True)
    for path in CHART[1]:
        (chart / Path(path).name).write_text(_git(repo, "show", f"HEAD:{path}"))
        sources.append(f"| vllm-stack/{Path(path).name} | {CHART[0]} | {commit} | {path} |")
    with zipfile.ZipFile(wheel) as whl:
        definitions = json.loads(whl.read(f"kubernetes_validate/kubernetes-json-schema/{CORE_VERSION}/_definitions.json"))
    kept = _reached(definitions["$defs"], list(CORE_KINDS.values()))
    (HERE / "core.json").write_text(json.dumps({"$schema": definitions["$schema"], "kinds": CORE_KINDS, "$defs": kept},
                                               separators=(",", ":"), sort_keys=True) + "\n")
    sources.append(f"| core.json | Kubernetes {CORE_VERSION.split('-')[0]} (kubernetes-validate, {wheel.name}) | - | "
                   f"kubernetes-json-schema/{CORE_VERSION}/_definitions.json, cut to what "
                   f"{', '.join(CORE_KINDS)} reach |")
    (HERE / "SOURCES.md").write_text("\n".join(sources) + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
