"""Every rendered document checked against the real schemas (``schemas/``, vendored at pinned
commits: SOURCES.md): Kubernetes' own for the core kinds (strict: an unknown field is refused,
as ``kubectl --validate=strict`` does), each CRD's openAPIV3Schema (made strict the same way:
an object that declares its properties takes no other, unless it says it keeps unknown
fields; the CEL rules, x-kubernetes-validations, are the API server's alone), and production-stack's values.schema.json over the chart's defaults, with every key
also checked against the chart's values.yaml (its schema lets a misspelt key through). Pure."""
from __future__ import annotations

import copy
import difflib
import json
from functools import lru_cache
from pathlib import Path

import jsonschema
import yaml

SCHEMAS = Path(__file__).parent / "schemas"
CRDS = {  # (apiVersion, kind) -> the vendored file
    ("gateway.envoyproxy.io/v1alpha1", "SecurityPolicy"): "securitypolicy.json",
    ("gateway.envoyproxy.io/v1alpha1", "BackendTrafficPolicy"): "backendtrafficpolicy.json",
    ("gateway.envoyproxy.io/v1alpha1", "Backend"): "backend.json",
    ("aigateway.envoyproxy.io/v1beta1", "AIGatewayRoute"): "aigatewayroute.json",
    ("aigateway.envoyproxy.io/v1beta1", "AIServiceBackend"): "aiservicebackend.json",
    ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.json",
    ("gateway.networking.k8s.io/v1", "GatewayClass"): "gatewayclass.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): "prometheusrule.json",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitor.json",
}
CORE = {("apps/v1", "Deployment"), ("v1", "ConfigMap"), ("v1", "Secret"), ("v1", "Service"),
        ("v1", "PersistentVolumeClaim")}


def _strict(schema):
    """A CRD schema in which an object with declared properties takes no others (the API server
    prunes an unknown field, silently: a misspelt one would be lost)."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@lru_cache(maxsize=None)
def _crd_validator(file: str) -> jsonschema.Validator:
    data = json.loads((SCHEMAS / file).read_text())
    schema = _strict(data["openAPIV3Schema"])
    # metadata is the API server's (ObjectMeta): the CRD leaves it open
    schema.setdefault("properties", {})["metadata"] = {"type": "object"}
    return jsonschema.Draft7Validator(schema)


@lru_cache(maxsize=None)
def _core() -> dict:
    return json.loads((SCHEMAS / "core.json").read_text())


@lru_cache(maxsize=None)
def _core_validator(kind: str) -> jsonschema.Validator:
    core = _core()
    schema = {"$schema": core["$schema"], "$defs": core["$defs"], "$ref": f"#/$defs/{core['kinds'][kind]}"}
    return jsonschema.Draft202012Validator(schema)


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(the document)"


def document_problems(doc: dict, label: str) -> list[str]:
    """What is wrong with one manifest, each naming ``label`` and the key."""
    if not isinstance(doc, dict):
        return [f"{label}: not a mapping"]
    api, kind = doc.get("apiVersion"), doc.get("kind")
    if (api, kind) in CRDS:
        validator = _crd_validator(CRDS[(api, kind)])
    elif (api, kind) in CORE:
        validator = _core_validator(kind)
    else:
        return [f"{label}: {api}/{kind} has no vendored schema (kubernetes_manifests/schemas)"]
    return [f"{label}: {_where(e)}: {e.message}" for e in
            sorted(validator.iter_errors(doc), key=lambda e: list(map(str, e.absolute_path)))]


@lru_cache(maxsize=None)
def chart_defaults() -> dict:
    return yaml.safe_load((SCHEMAS / "vllm-stack" / "values.yaml").read_text())


@lru_cache(maxsize=None)
def chart_schema() -> dict:
    return json.loads((SCHEMAS / "vllm-stack" / "values.schema.json").read_text())


def chart_version() -> str:
    return yaml.safe_load((SCHEMAS / "vllm-stack" / "Chart.yaml").read_text())["version"]


def merged(defaults, ours):
    """Helm's merge of a values file over the chart's: maps key by key, anything else replaced."""
    if isinstance(defaults, dict) and isinstance(ours, dict):
        out = copy.deepcopy(defaults)
        for key, value in ours.items():
            out[key] = merged(defaults.get(key), value) if key in defaults else copy.deepcopy(value)
        return out
    return copy.deepcopy(ours)


def _unknown_keys(value, schema: dict, defaults, path: tuple) -> list[tuple[tuple, str, list[str]]]:
    """(path, key, the keys known there) for each key neither the schema nor values.yaml has at a
    place whose keys they declare."""
    out = []
    if isinstance(value, dict) and isinstance(schema, dict):
        props = schema.get("properties")
        free = props is None or schema.get("additionalProperties") not in (None, False)
        known = set(props or {}) | (set(defaults) if isinstance(defaults, dict) else set())
        for key, sub in value.items():
            if not free and key not in known:
                out.append((path, key, sorted(known)))
                continue
            out += _unknown_keys(sub, (props or {}).get(key, {}),
                                 defaults.get(key) if isinstance(defaults, dict) else None, path + (key,))
    elif isinstance(value, list) and isinstance(schema, dict) and isinstance(schema.get("items"), dict):
        example = defaults[0] if isinstance(defaults, list) and defaults else None
        for i, item in enumerate(value):
            out += _unknown_keys(item, schema["items"], example, path + (i,))
    return out


def values_problems(values: dict, label: str) -> list[str]:
    """The chart's values: its schema over its defaults merged with these, and no key the chart
    does not know (each with the nearest known key)."""
    problems = []
    for path, key, known in _unknown_keys(values, chart_schema(), chart_defaults(), ()):
        where = ".".join(str(p) for p in path + (key,))
        near = difflib.get_close_matches(key, known, n=1)
        problems.append(f"{label}: {where}: not a key of production-stack's values (vllm-stack {chart_version()})"
                        + (f"; did you mean {near[0]}?" if near else ""))
    validator = jsonschema.Draft202012Validator(chart_schema())
    for error in sorted(validator.iter_errors(merged(chart_defaults(), values)), key=lambda e: list(map(str, e.absolute_path))):
        problems.append(f"{label}: {_where(error)}: {error.message}")
    return problems


# the keys of a document that name another object, and the kind each names when it says none
REFERENCES = {"parentRefs": "Gateway", "targetRefs": None, "backendRefs": None, "backendRef": None,
              "credentialRefs": "Secret", "certificateRefs": "Secret"}
# the kind a backendRef names by default, by the kind of the document it is in
BACKEND_OF = {"AIGatewayRoute": "AIServiceBackend", "HTTPRoute": "Service", "AIServiceBackend": "Backend"}


def _references(node, kind: str, key: str = ""):
    """(the key, the kind named, the name) of every reference in a document."""
    if isinstance(node, dict):
        for k, value in node.items():
            if k in REFERENCES:
                for ref in (value if isinstance(value, list) else [value]):
                    if isinstance(ref, dict) and "name" in ref:
                        named = ref.get("kind") or REFERENCES[k] or BACKEND_OF.get(kind, "Service")
                        yield k, named, ref["name"]
            elif k == "gatewayClassName":
                yield k, "GatewayClass", value
            else:
                yield from _references(value, kind, k)
    elif isinstance(node, list):
        for item in node:
            yield from _references(item, kind, key)


def reference_problems(files: dict[str, list[dict]], made: set[tuple[str, str]]) -> list[str]:
    """Each parentRefs, targetRefs, backendRefs (credentialRefs, certificateRefs, gatewayClassName)
    that names an object no rendered file holds and no step makes (``made``: (kind, name))."""
    present = {(d.get("kind"), (d.get("metadata") or {}).get("name")) for docs in files.values() for d in docs} | made
    problems = []
    for path, docs in files.items():
        for i, doc in enumerate(docs):
            for key, kind, name in _references(doc.get("spec") or {}, doc.get("kind")):
                if (kind, name) not in present:
                    problems.append(f"{path} #{i + 1} ({doc.get('kind')} {(doc.get('metadata') or {}).get('name')}): "
                                    f"its {key} names {kind} {name}, which no rendered file holds and no step makes")
    return problems
