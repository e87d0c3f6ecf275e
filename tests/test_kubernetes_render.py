"""The fleet rendered for Kubernetes (kubernetes_manifests/): the same choices as the SSH deploy
on several hardware profiles (GB10, an RTX 5090 on driver 610, an H100, 4 x H200; real and
built nvidia-smi captures), every file passing the vendored schemas, and bad input refused
with the host, or the file and key, named. The lab's test (tests/lab/test_lab_kubernetes.py)
renders the lab from its hosts' facts and runs a rendered pod under `podman kube play`."""
import copy
import itertools
import json
import os
import re
import subprocess
import sys

import pytest
import yaml

from converge.facts.host import parse_meminfo
from converge.facts.nvidia import parse_gpu_query, parse_version
from kubernetes_manifests import checks, hardware, pods
from kubernetes_manifests.render import RenderError, Settings, render
from kubernetes_manifests.serving import ServingHost
from kubernetes_manifests.values import split_args
from serving.key_limits import OPERATOR, UNLIMITED, Limits
from roles.preflight.select import choose
from serving.replicas import Served
from roles.service.container import container_spec
from serving.vllm_serve import diffusion_wanted
from tests.conftest import FIXTURES, ROOT

SMI = FIXTURES / "nvidia-smi"
HOST_MEM = parse_meminfo("MemTotal: 131072000 kB\nMemAvailable: 120000000 kB\n")


def facts(query, version, arch="x86_64", meminfo=HOST_MEM):
    v = parse_version(version.read_text())
    return {"arch": arch, "meminfo": meminfo,
            "nvidia": {"gpus": parse_gpu_query(query.read_text()), "cuda_version": v.get("cuda_version"),
                       "driver_version": v.get("driver_version"), "compute_apps": []}}


PROFILES = {  # host -> (its facts, its variables as an inventory would set them)
    "spark01": (facts(SMI / "built/gb10-query.csv", SMI / "built/gb10-version.txt", "aarch64",
                      parse_meminfo((SMI / "built/gb10-meminfo.txt").read_text())), {"gpu_memory_utilization": 0.7}),
    "rtx01": (facts(SMI / "built/r610-rtx5090-query.csv", SMI / "built/r610-version.txt"), {}),
    "h100-01": (facts(SMI / "h100/idle-query.csv", SMI / "h100/idle-version.txt"), {"canvas_length": 512}),
    "hgx01": (facts(SMI / "built/h200x4-query.csv", SMI / "h200x2/version.txt"),
              {"models": [{"family": "diffusiongemma", "gpus": 2}, {"family": "gemma4", "gpus": 2}]}),
}
KEYS = {OPERATOR: UNLIMITED, "alice": Limits(requests_per_minute=10, tokens_per_day=2000),
        "webui": Limits(requests_per_minute=30, front_end=True, all_users_requests_per_minute=200)}


def serving(profiles=PROFILES) -> list[ServingHost]:
    out = []
    for name, (f, v) in profiles.items():
        out.append(ServingHost(name, v, f["arch"], f["nvidia"]["cuda_version"], tuple(f["nvidia"]["gpus"]),
                               choose(f, v)))
    return out


@pytest.fixture(scope="module")
def rendered():
    return render(serving(), KEYS, Settings(), {})


def _flags(argv: list[str]) -> dict:
    """flag -> value(s) of a vllm serve command line (underscores read as vLLM reads them)."""
    out, key = {}, None
    for arg in argv:
        if arg.startswith("--"):
            key = arg.replace("_", "-")
            out[key] = []
        elif key:
            out[key].append(arg)
    return out


def test_the_render_and_the_ssh_deploy_agree_on_every_choice_of_every_profile(rendered):
    values = yaml.safe_load(rendered["values.yaml"])
    specs = values["servingEngineSpec"]["modelSpec"]
    for host in serving():
        for placed in host.choice.replicas:
            served = Served.of(host.vars, placed)
            ssh_cmd = container_spec(host.vars, host.choice.image, served, True).cmd
            mine = [s for s in specs if s["modelURL"] == placed.model and f"{s['repository']}:{s['tag']}" ==
                    host.choice.image and s["vllmConfig"]["gpuMemoryUtilization"] == placed.utilization and
                    s["requestGPU"] == placed.tensor_parallel_size and
                    hardware.product_label(host.product) in json.dumps(s["nodeSelectorTerms"])]
            assert len(mine) == 1, (host.name, placed.model, [s["name"] for s in specs])
            spec = mine[0]
            deployment = next(d for d in yaml.safe_load_all(rendered[f"serving/{spec['name']}.yaml"])
                              if d["kind"] == "Deployment")
            pod_cmd = deployment["spec"]["template"]["spec"]["containers"][0]["command"]
            assert pod_cmd[:3] == ["vllm", "serve", placed.model] and ssh_cmd[0] == placed.model
            ssh_flags, pod_flags = _flags(ssh_cmd), _flags(pod_cmd)
            # the same vllm serve, but where vLLM listens (the pod's own address, the chart's port) and
            # the prefix cache the chart always names (on: vLLM's default, which the SSH deploy leaves)
            for flags in (ssh_flags, pod_flags):
                del flags["--host"], flags["--port"]
            assert pod_flags.pop("--enable-prefix-caching") == []
            assert pod_flags == ssh_flags, host.name
            config = dict(json.loads(ssh_flags["--diffusion-config"][0]), **json.loads(ssh_flags["--hf-overrides"][0])) \
                if "--diffusion-config" in ssh_flags else None
            if placed.family == "diffusiongemma":
                assert config == diffusion_wanted(host.vars), host.name
    # the replicas: as many as the SSH deploy places, each spec's count those of its hardware
    assert sum(s["replicaCount"] for s in specs) == sum(len(h.choice.replicas) for h in serving())
    by_name = {s["name"]: s for s in specs}
    # 4 x H200, two GPUs for each family: a replica per GPU, as on the host
    assert [(by_name[n]["replicaCount"], by_name[n]["requestGPU"]) for n in ("diffusiongemma-h200", "gemma4-h200")] \
        == [(2, 1), (2, 1)]
    # the RTX 5090 on driver 610 (CUDA 13.3): the cu130 tag, NVFP4
    assert by_name["diffusiongemma-geforce-rtx-5090"]["tag"] == "gemma-x86_64-cu130"
    assert by_name["diffusiongemma-h100-80gb-hbm3"]["vllmConfig"]["extraArgs"][
        by_name["diffusiongemma-h100-80gb-hbm3"]["vllmConfig"]["extraArgs"].index("--diffusion-config") + 1] == \
        '{"canvas_length": 512, "max_denoising_steps": 48}'


def test_each_image_tag_is_placed_on_the_driver_cuda_range_the_catalog_picks_it_for():
    """The nodeSelectorTerms say in GFD's labels what choose_image says of a host: a node whose
    driver CUDA is in the terms gets the tag the catalog picks for it, and no other node."""
    from roles.preflight.select import choose_image
    for lowest, below in [((13, 0), None), ((12, 9), (13, 0)), ((12, 4), (13, 1)), ((11, 8), (13, 0)),
                          ((12, 2), None), ((12, 0), (12, 9))]:
        terms = hardware.cuda_terms(lowest, below)
        for major, minor in itertools.product(range(10, 16), range(0, 11)):
            inside = (major, minor) >= lowest and (below is None or (major, minor) < below)
            labels = {hardware.CUDA_MAJOR: major, hardware.CUDA_MINOR: minor}

            def holds(e):
                value = labels[e["key"]]
                return {"In": value in map(int, e["values"]), "Gt": value > int(e["values"][0]),
                        "Lt": value < int(e["values"][0])}[e["operator"]]
            assert any(all(holds(e) for e in term) for term in terms) == inside, (lowest, below, major, minor)
    # and for the catalog's real rows: the H100's tag, and the 12.9 driver's
    assert choose_image("x86_64", "12.9", {})[0].endswith("gemma-cu129")


def test_every_rendered_file_passes_the_vendored_schemas_and_a_misspelt_field_does_not(rendered):
    docs = [(path, d) for path, text in rendered.items() if path.endswith(".yaml") and path != "values.yaml"
            for d in yaml.safe_load_all(text)]
    kinds = {d["kind"] for _, d in docs}
    assert kinds >= {"Deployment", "Service", "PersistentVolumeClaim", "AIGatewayRoute", "AIServiceBackend", "Backend",
                     "Gateway", "GatewayClass",
                     "SecurityPolicy", "BackendTrafficPolicy", "PrometheusRule", "ServiceMonitor", "ConfigMap"}
    for path, doc in docs:
        assert checks.document_problems(doc, path) == [], path
    assert checks.values_problems(yaml.safe_load(rendered["values.yaml"]), "values.yaml") == []
    # each kind's schema refuses a field it does not have (the API server would drop it silently)
    for path, doc in docs:
        broken = copy.deepcopy(doc)
        (broken.get("spec") or broken.setdefault("data", {})).update({"replicaz": 1}) if doc["kind"] != "ConfigMap" \
            else broken.update({"datta": {}})
        assert checks.document_problems(broken, path), (path, doc["kind"])


def _documents(rendered) -> dict[str, list[dict]]:
    return {path: list(yaml.safe_load_all(text)) for path, text in rendered.items()
            if path.endswith(".yaml") and path != "values.yaml"}


def test_the_route_ends_at_a_gateway_with_an_https_listener_and_every_reference_resolves(rendered):
    """The AIGatewayRoute's parent is a Gateway the render writes (its class Envoy Gateway's), with one
    HTTPS listener whose certificate is the Secret the README's step makes; every parentRefs,
    targetRefs, backendRefs of every file names an object a file holds or a step makes (the HTTPRoute
    Envoy AI Gateway makes of the route); a dangling one fails the render, named."""
    from kubernetes_manifests import gateway
    files = _documents(rendered)
    kinds = {d["kind"]: d for d in files["gateway/gateway.yaml"] + files["gateway/policies.yaml"]}
    listener, = kinds["Gateway"]["spec"]["listeners"]
    assert (listener["protocol"], listener["port"], listener["tls"]["mode"]) == ("HTTPS", 443, "Terminate")
    assert listener["tls"]["certificateRefs"] == [{"group": "", "kind": "Secret", "name": "dgemma-gateway-tls"}]
    assert kinds["GatewayClass"]["spec"]["controllerName"] == "gateway.envoyproxy.io/gatewayclass-controller"
    assert kinds["Gateway"]["spec"]["gatewayClassName"] == kinds["GatewayClass"]["metadata"]["name"]
    assert kinds["AIGatewayRoute"]["spec"]["parentRefs"][0]["name"] == kinds["Gateway"]["metadata"]["name"]
    made = gateway.made_by_steps("dgemma")
    assert checks.reference_problems(files, made) == []
    seen = {kind for docs in files.values() for d in docs for _, kind, _ in checks._references(d.get("spec") or {},
                                                                                              d["kind"])}
    assert seen >= {"Gateway", "GatewayClass", "Secret", "HTTPRoute", "AIServiceBackend", "Backend"}
    # a route whose Gateway nothing renders, and a policy on a route nothing makes
    broken = copy.deepcopy(files)
    broken["gateway/gateway.yaml"] = [d for d in broken["gateway/gateway.yaml"] if d["kind"] != "Gateway"]
    problems = checks.reference_problems(broken, made)
    assert any("its parentRefs names Gateway dgemma-gateway, which no rendered file holds" in p for p in problems)
    assert checks.reference_problems(files, made - {("HTTPRoute", "dgemma-api")})
    # the README installs what the files need, at the versions their schemas come from
    readme = rendered["README.md"]
    for step in ("helm upgrade -i eg oci://docker.io/envoyproxy/gateway-helm --version v1.9.0",
                 "helm upgrade -i aieg-crd oci://docker.io/envoyproxy/ai-gateway-crds-helm --version v1.1.0",
                 "helm upgrade -i aieg oci://docker.io/envoyproxy/ai-gateway-helm --version v1.1.0",
                 "envoy-gateway-values-addon.yaml", "token_ratelimit/redis.yaml",
                 "kubectl -n dgemma create secret tls dgemma-gateway-tls --cert=GATEWAY_CERT_FILE",
                 "kubectl apply -f gateway/", "--for=condition=Programmed"):
        assert step in readme, step
    sources = (ROOT / "kubernetes_manifests" / "schemas" / "SOURCES.md").read_text()
    assert "| gateway.json | kubernetes-sigs/gateway-api v1.6.1 |" in sources


def test_the_keys_limits_become_envoy_rate_limits_on_the_key_the_secret_names(rendered):
    docs = {d["kind"]: d for d in yaml.safe_load_all(rendered["gateway/policies.yaml"])}
    auth = docs["SecurityPolicy"]["spec"]["apiKeyAuth"]
    assert auth["credentialRefs"][0]["name"] == "dgemma-api-keys" and auth["forwardClientIDHeader"] == "x-dgemma-key"
    rules = docs["BackendTrafficPolicy"]["spec"]["rateLimit"]["global"]["rules"]
    shown = [(r["clientSelectors"][0]["headers"], r["limit"]) for r in rules]
    assert ([{"name": "x-dgemma-key", "type": "Exact", "value": "alice"}], {"requests": 10, "unit": "Minute"}) in shown
    assert ([{"name": "x-dgemma-key", "type": "Exact", "value": "alice"}], {"requests": 2000, "unit": "Day"}) in shown
    assert ([{"name": "x-dgemma-key", "type": "Exact", "value": "webui"},
             {"name": "x-openwebui-user-email", "type": "Distinct"}], {"requests": 30, "unit": "Minute"}) in shown
    assert ([{"name": "x-dgemma-key", "type": "Exact", "value": "webui"}], {"requests": 200, "unit": "Minute"}) in shown
    day = next(r for r in rules if r["limit"]["unit"] == "Day")
    assert day["cost"]["response"]["metadata"]["key"] == docs["AIGatewayRoute"]["spec"]["llmRequestCosts"][0]["metadataKey"]
    assert not any("api_key_file" in json.dumps(r) for r in rules), "the operator's key has no limits"
    text = "".join(rendered.values())
    assert not re.search(r"\b[0-9a-f]{64}\b", text) and "sk-" not in text, "no key, no key hash"


def test_an_unknown_gpu_and_a_misspelt_or_wrongly_typed_value_are_refused_naming_where():
    broken = dict(PROFILES)
    f, v = copy.deepcopy(PROFILES["rtx01"])
    hosts = serving(broken)
    odd = ServingHost("rtx02", v, "x86_64", "13.0", ({**f["nvidia"]["gpus"][0], "name": "[N/A]"},), hosts[1].choice)
    with pytest.raises(RenderError) as refused:
        render(hosts + [odd], KEYS, Settings(), {})
    assert refused.value.problems[0].startswith("rtx02: gpus[0].name '[N/A]' is no GPU that GPU Feature Discovery names")
    riscv = ServingHost("rv01", v, "riscv64", "13.0", f["nvidia"]["gpus"], hosts[1].choice)
    with pytest.raises(RenderError, match="rv01: arch 'riscv64' has no Kubernetes name"):
        render([riscv], KEYS, Settings(), {})
    settings = Settings(values={"routerSpec": {"replicaCont": 2}, "servingEngineSpec": {"imagePullPolicy": "Sometimes"}},
                        where="inventory/group_vars/all.yml:12: kubernetes.values")
    with pytest.raises(RenderError) as refused:
        render(hosts, KEYS, settings, {})
    problems = "\n".join(refused.value.problems)
    assert ("inventory/group_vars/all.yml:12: kubernetes.values: routerSpec.replicaCont: not a key of "
            "production-stack's values (vllm-stack 0.1.12); did you mean replicaCount?") in problems
    assert "servingEngineSpec.imagePullPolicy: 'Sometimes' is not one of ['Always', 'IfNotPresent', 'Never']" in problems
    # a value the chart knows, of the right type, is laid over the rendered ones
    values = yaml.safe_load(render(hosts, KEYS, Settings(values={"routerSpec": {"replicaCount": 2}}), {})["values.yaml"])
    assert values["routerSpec"]["replicaCount"] == 2 and values["routerSpec"]["routingLogic"] == "roundrobin"


def test_the_deployment_is_the_charts_command_line_and_placement():
    spec = {"name": "x", "repository": "vllm/vllm-openai", "tag": "t", "modelURL": "m", "replicaCount": 1,
            "requestCPU": 4, "requestMemory": "8Gi", "requestGPU": 2, "pvcStorage": "10Gi",
            "pvcAccessMode": ["ReadWriteOnce"], "hf_token": {"secretName": "h", "secretKey": "k"},
            "nodeSelectorTerms": [{"matchExpressions": [{"key": "a", "operator": "In", "values": ["b"]}]}],
            "vllmConfig": {"gpuMemoryUtilization": 0.9, "tensorParallelSize": 2, "maxNumSeqs": 4,
                           "enableChunkedPrefill": True, "enablePrefixCaching": True, "extraArgs": ["--x", "1"]}}
    values = checks.merged(checks.chart_defaults(), {"servingEngineSpec": {"vllmApiKey": {"secretName": "a", "secretKey": "b"}}})
    _, deployment, _ = pods.deployment(values, spec, "r", "ns")
    pod = deployment["spec"]["template"]["spec"]
    # helm/templates/deployment-vllm-multi.yaml's order
    assert pod["containers"][0]["command"] == ["vllm", "serve", "m", "--host", "0.0.0.0", "--port", "8000",
                                               "--enable-chunked-prefill", "--enable-prefix-caching",
                                               "--tensor-parallel-size", "2", "--max-num-seqs", "4",
                                               "--gpu_memory_utilization", "0.9", "--x", "1"]
    assert {"name": "shm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert pod["runtimeClassName"] == "nvidia" and pod["containers"][0]["imagePullPolicy"] == "Always"
    assert split_args(("m", "--port", "1", "--gpu-memory-utilization", "0.5", "--revision", "abc", "--y"))[2] == "abc"


def test_invoke_render_refuses_a_misspelt_setting_before_reaching_any_host(tmp_path):
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text("all:\n  vars:\n    kubernetes:\n      namespce: lab\n"
                                         "  hosts:\n    rtx01:\n      ansible_host: 192.0.2.1\n")
    proc = subprocess.run([sys.executable, "-m", "invoke", "render", "--target", "kubernetes", "--out",
                           str(tmp_path / "out"), "--inventory", str(inventory)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "hosts.yml:3: kubernetes: Additional properties are not allowed ('namespce' was unexpected)" in proc.stderr
    assert not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, "-m", "invoke", "render", "--target", "kubernetes", "--inventory",
                           str(inventory)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "give --out FOLDER" in proc.stderr
