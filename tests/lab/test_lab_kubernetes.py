"""The lab's fleet rendered for Kubernetes (`invoke render --target kubernetes`) from its hosts'
own facts, every file checked against the real schemas, and the serving Deployment rendered for
h100-01 run for real: `podman kube play` on h100-01 (its SSH-deployed replica stopped meanwhile,
as when a host moves to the cluster) with the lab's vLLM stand-in image, answering /v1/models and
a chat with its key, then `podman kube down` leaving no pod behind. The two things a cluster adds
that podman does not (the device plugin's GPU, the downward API's pod IP) are lab/kube_play.py's."""
import json
import os
import re
import shutil
import stat
import subprocess
import time

import pytest
import yaml

from lab import config
from lab.kube_play import as_cluster_runs, pod_containers_conf, secret_json
from tests.lab.conftest import deploy_json, invoke, ssh

HOST = "h100-01"
PORT = 18000  # where the pod's vLLM port is published on h100-01 (its front door has 8000)


@pytest.fixture(scope="module")
def deployed(lab):
    proc, _ = deploy_json("--hosts", HOST)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def _curl(path: str, key: str | None, body: dict | None = None) -> tuple[int, str]:
    """(curl's exit code, the answer) from h100-01 to the pod; the key on curl's stdin (-H @-)."""
    data = f" -H 'content-type: application/json' -d '{json.dumps(body)}'" if body else ""
    proc = ssh(HOST, f"curl -sS -m 20 -w '\\n%{{http_code}}' -H @-{data} http://127.0.0.1:{PORT}{path}",
               input=f"Authorization: Bearer {key}\n" if key else "X-No-Key: 1\n", check=False)
    return proc.returncode, proc.stdout


def test_the_fleet_renders_for_kubernetes_and_its_h100_pod_runs_under_podman_kube_play(deployed, tmp_path):
    out = tmp_path / "k8s"
    proc = invoke("render", "--target", "kubernetes", "--out", out, "--gateway-certificate")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "each checked against its project's schema" in proc.stdout
    values = yaml.safe_load((out / "values.yaml").read_text())
    specs = {s["name"]: s for s in values["servingEngineSpec"]["modelSpec"]}
    # the same choices as the SSH deploy's, from the same facts (`invoke facts`)
    facts = json.loads(invoke("facts", "--hosts", HOST, "--json", "-", check=True).stdout)["hosts"][HOST]["choice"]
    [spec] = [s for s in specs.values() if s["modelURL"] == facts["model"] and any(
        e["values"] == ["NVIDIA-H100-80GB-HBM3"] for t in s["nodeSelectorTerms"] for e in t["matchExpressions"])]
    assert f"{spec['repository']}:{spec['tag']}" == facts["image"]
    assert spec["vllmConfig"]["gpuMemoryUtilization"] == facts["gpu_memory_utilization"]
    readme = (out / "README.md").read_text()
    assert "| " + spec["name"] + " |" in readme and HOST in readme
    # the Gateway's certificate: the fleet CA's, kept with the credentials (its key 0600), never in the render
    cert, key_file = re.search(r"create secret tls dgemma-gateway-tls --cert=(\S+) --key=(\S+)", readme).groups()
    assert stat.S_IMODE(os.stat(key_file).st_mode) == 0o600 and not list(out.rglob("*.key"))
    verified = subprocess.run(["openssl", "verify", "-CAfile", str(config.CA_FILE), cert], capture_output=True, text=True)
    assert verified.returncode == 0, verified.stdout + verified.stderr

    docs = list(yaml.safe_load_all((out / "serving" / f"{spec['name']}.yaml").read_text()))
    claim, deployment = [d for d in docs if d["kind"] in ("PersistentVolumeClaim", "Deployment")]
    cdi = json.loads(ssh(HOST, "cat /etc/cdi/nvidia.yaml").stdout)
    played = as_cluster_runs(deployment, cdi, ["0"], {8000: PORT})
    key = config.API_KEY_FILE.read_text().strip()
    engine = values["servingEngineSpec"]
    conf = pod_containers_conf(ssh(HOST, "cat /etc/containers/containers.conf").stdout)
    ssh(HOST, "cat > /root/kube-containers.conf", input=conf)
    ssh(HOST, "cat > /root/k8s-serving.yaml", input=yaml.safe_dump_all([claim, played]))
    kube = "CONTAINERS_CONF=/root/kube-containers.conf podman kube"
    # as a host moves to the cluster: its replica stopped, its GPU handed to the pod
    assert invoke("stop", "--hosts", HOST).returncode == 0
    try:
        # the Secrets the README has the operator make, by the names the values give
        ssh(HOST, f"podman secret create {engine['vllmApiKey']['secretName']} -",
            input=secret_json({engine["vllmApiKey"]["secretKey"]: key}))
        ssh(HOST, f"podman secret create {spec['hf_token']['secretName']} -",
            input=secret_json({spec["hf_token"]["secretKey"]: "hf_lab_not_used"}))
        played_proc = ssh(HOST, f"{kube} play /root/k8s-serving.yaml", check=False, timeout=300)
        assert played_proc.returncode == 0, played_proc.stderr[-2000:]
        deadline, answer = time.monotonic() + 90, ""
        while time.monotonic() < deadline:
            code, answer = _curl("/v1/models", key)
            if code == 0 and answer.endswith("\n200"):
                break
            time.sleep(1)
        assert answer.endswith("\n200"), answer + ssh(HOST, "podman logs --tail 20 $(podman ps -aq --filter "
                                                          "name=deployment-vllm | tail -1)", check=False).stderr
        assert {m["id"] for m in json.loads(answer.rsplit("\n", 1)[0])["data"]} >= {"diffusiongemma", spec["modelURL"]}
        code, answer = _curl("/v1/chat/completions", key, {"model": "diffusiongemma", "max_tokens": 8,
                                                           "messages": [{"role": "user", "content": "hi"}]})
        body, status = answer.rsplit("\n", 1)
        assert status == "200" and json.loads(body)["choices"][0]["message"]["content"], answer
        assert _curl("/v1/models", None)[1].endswith("\n401"), "the pod takes the key it was given, no other"
        # the command line the chart writes reached vLLM: its diffusion settings among them
        logs = ssh(HOST, "podman logs $(podman ps -q --filter name=deployment-vllm)", check=False)
        assert '"--diffusion-config": {"canvas_length": 256, "max_denoising_steps": 48}' in logs.stdout + logs.stderr
    finally:
        down = ssh(HOST, f"{kube} down /root/k8s-serving.yaml", check=False, timeout=120)
        left = ssh(HOST, "podman pod ps -q --filter name=deployment-vllm; podman ps -aq --filter name=deployment-vllm",
                   check=False).stdout.strip()
        ssh(HOST, f"podman volume rm -f {claim['metadata']['name']}; podman secret rm "
                  f"{engine['vllmApiKey']['secretName']} {spec['hf_token']['secretName']}; "
                  f"rm -f /root/k8s-serving.yaml /root/kube-containers.conf", check=False)
        started = invoke("start", "--hosts", HOST)
    assert down.returncode == 0 and not left, (down.stderr, left)
    assert started.returncode == 0, started.stdout[-2000:]
    again = ssh(HOST, "curl -sk -m 20 -o /dev/null -w '%{http_code}' -H @- https://127.0.0.1:8000/v1/models",
                input=f"Authorization: Bearer {key}\n", check=False).stdout
    assert again == "200", f"h100-01 serves again as the SSH fleet's: {again}"


def test_a_misspelt_value_and_a_wrong_type_are_refused_naming_the_file_and_key(deployed, tmp_path):
    """The chart's own schema lets a misspelt key through; the render checks every key against its
    values.yaml too, and names where it was written. Nothing is written."""
    inventory = tmp_path / "inventory"
    shutil.copytree(config.STATE / "inventory", inventory)
    group = inventory / "group_vars" / "h100.yml"
    text = group.read_text() + ("kubernetes:\n  values:\n    routerSpec:\n      replicaCont: 2\n"
                                "    servingEngineSpec:\n      imagePullPolicy: Sometimes\n")
    group.write_text(text)
    out = tmp_path / "k8s"
    proc = invoke("render", "--target", "kubernetes", "--out", out, "--hosts", HOST, inventory=inventory)
    assert proc.returncode == 1, proc.stdout[-2000:]
    line = text.splitlines().index("  values:") + 1
    assert re.search(rf"h100\.yml:{line}: kubernetes\.values: routerSpec\.replicaCont: not a key of "
                     rf"production-stack's values .*did you mean replicaCount\?", proc.stderr), proc.stderr[-2000:]
    assert "servingEngineSpec.imagePullPolicy: 'Sometimes' is not one of" in proc.stderr, proc.stderr[-2000:]
    assert not out.exists(), "nothing is written when anything is wrong"
