"""The DGX Spark as seed 004 runs it: the real Docker engine (Debian's docker.io)
on an aarch64 host, the GPU handed over by --gpus through NVIDIA's runtime hook
(the GPU stand-in's), reached as a user whose sudo asks a password. Every day-2
task on it."""
import csv
import json

import pytest

from lab import images
from tests.lab.conftest import deploy_json, invoke, ssh

UNIT = "docker-vllm-diffusiongemma.service"


@pytest.fixture(scope="module")
def deployed(lab):
    proc, data = deploy_json("--hosts", "spark01,rtx01")
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def test_spark01_serves_the_aarch64_image_under_the_real_docker_engine(deployed, tmp_path):
    out = tmp_path / "verify.json"
    proc = invoke("verify", "--hosts", "spark01,rtx01", "--json", out)
    not_passed = [line for line in proc.stdout.splitlines() if not line.rstrip().endswith((" pass", " skip n/a"))]
    assert proc.returncode == 0 and json.loads(out.read_text())["ok"], "\n".join(not_passed)[-4000:]
    assert ssh("spark01", f"systemctl is-active {UNIT}").stdout.strip() == "active"
    running = dict(line.split() for line in ssh("spark01", "docker ps --format '{{.Names}} {{.Image}}'").stdout.splitlines())
    # vLLM, its front door and the node exporter (the official images' names, from the lab's registry)
    assert running == {"vllm-diffusiongemma": "10.213.0.1:5000/vllm/vllm-openai:gemma-aarch64-cu130",
                       "dgemma-frontdoor": "10.213.0.1:5000/library/haproxy:3.0",
                       "dgemma-node-exporter": "10.213.0.1:5000/prom/node-exporter:v1.5.0"}
    assert ssh("spark01", "docker image inspect --format '{{.Architecture}}' "
                          "10.213.0.1:5000/vllm/vllm-openai:gemma-aarch64-cu130").stdout.strip() == "arm64"
    inside = ssh("spark01", "docker exec vllm-diffusiongemma sh -c "
                            "'uname -m; nvidia-smi --query-gpu=name --format=csv,noheader'").stdout.split("\n")
    assert inside[:2] == ["aarch64", "NVIDIA GB10"]  # the GPU, through --gpus and the runtime hook
    # handed over by uuid (--gpus device=UUID), as the placement chose; the container sees that GPU alone
    gb10, rtx5090 = "GPU-9b10c0de-0000-4000-8000-0000000000b1", "GPU-5090c0de-0000-4000-8000-000000005090"
    requests = json.loads(ssh("spark01", "docker inspect --format '{{json .HostConfig.DeviceRequests}}' "
                                         "vllm-diffusiongemma").stdout)
    assert [r["DeviceIDs"] for r in requests] == [[gb10]]
    assert ssh("spark01", "docker exec vllm-diffusiongemma nvidia-smi -L").stdout == f"GPU 0: NVIDIA GB10 (UUID: {gb10})\n"
    # podman: the CDI device named by the uuid
    assert ssh("rtx01", "podman exec vllm-diffusiongemma nvidia-smi -L").stdout == \
        f"GPU 0: NVIDIA GeForce RTX 5090 (UUID: {rtx5090})\n"
    assert f"--device nvidia.com/gpu={rtx5090} " in ssh("rtx01", "cat /etc/systemd/system/podman-vllm-diffusiongemma.service").stdout
    assert ssh("spark01", "docker info --format '{{.CgroupVersion}} {{.DefaultRuntime}}'").stdout.split() == \
        ["2", "runcx86"]


def test_status_shows_the_docker_hosts_digest(deployed, tmp_path):
    out = tmp_path / "status.json"
    proc = invoke("status", "--hosts", "spark01", "--json", out)
    spark = json.loads(out.read_text())["hosts"]["spark01"]
    assert proc.returncode == 0, proc.stdout
    assert (spark["unit"], spark["unit_state"], spark["container"], spark["health"]) == \
        (UNIT, "active/running", "running", "200")
    assert spark["digest"] == images.registry_digest("gemma-aarch64-cu130")


def test_logs_stop_start_and_bench_on_a_docker_host(deployed, tmp_path):
    # units that conflict with the replica (stopped by start, back with stop --resume) are the
    # runtime's business in no way: tests/lab/test_lab_day2.py has them, on a podman host
    invoke("stop", "--hosts", "spark01", check=True)
    assert ssh("spark01", f"systemctl is-active {UNIT}", check=False).stdout.strip() == "inactive"
    assert "gate passed" in invoke("start", "--hosts", "spark01", check=True).stdout
    assert ssh("spark01", f"systemctl is-active {UNIT}").stdout.strip() == "active"
    logs = invoke("logs", "--hosts", "spark01", "--lines", "5", check=True).stdout
    assert [l for l in logs.splitlines() if l.startswith("spark01 | ")]
    js, cs = tmp_path / "bench.json", tmp_path / "bench.csv"
    invoke("bench", "--hosts", "spark01", "--json", js, "--csv", cs, "--repeats", "2", check=True)
    figures = {f["scenario"]: f for f in json.loads(js.read_text())["hosts"][0]["figures"]}
    assert figures["full_canvas"]["mean_output_tokens"] == 256 and figures["concurrency_4"]["errors"] == 0
    assert list(csv.DictReader(cs.open()))[0]["published"] == "158.7 prose / 143.1 code"


def test_recover_clears_a_crash_loop_on_spark01(deployed):
    # the unified memory is taken by something else: vLLM's memory check fails at every restart
    invoke("lab.gpu", "--host", "spark01", "--held-mib", "100000", check=True)
    try:
        proc = invoke("restart", "--hosts", "spark01")
        assert proc.returncode != 0 and "Free memory on device" in proc.stdout
        assert ssh("spark01", f"systemctl is-active {UNIT}", check=False).stdout.strip() in ("failed", "activating")
    finally:
        invoke("lab.gpu", "--host", "spark01", "--clear", check=True)
    proc = invoke("recover", "--hosts", "spark01", check=True)
    for said in ("GPU answers", "recovered: drained in", "unit stopped and reset", "container removed",
                 "gate passed"):
        assert said in proc.stdout, proc.stdout[-2000:]
    assert ssh("spark01", f"systemctl is-active {UNIT}").stdout.strip() == "active"


def test_preflight_names_the_remedy_when_docker_has_no_nvidia_runtime(deployed):
    daemon = "/etc/docker/daemon.json"
    original = ssh("spark01", f"cat {daemon}").stdout
    stripped = json.loads(original)
    del stripped["runtimes"]["nvidia"]
    # a reload (SIGHUP) takes daemon.json's runtimes as a restart does, and leaves the containers running
    ssh("spark01", f"cat > {daemon} <<'EOF'\n{json.dumps(stripped)}\nEOF\nsystemctl reload docker")
    try:
        proc, data = deploy_json("--hosts", "spark01")
        failed = [t for t in data["hosts"]["spark01"]["tasks"] if t["status"] == "failed"]
        assert failed[0]["role"] == "preflight" and failed[0]["task"] == "docker GPU access"
        assert "nvidia-ctk runtime configure --runtime=docker" in failed[0]["message"]
    finally:
        ssh("spark01", f"cat > {daemon} <<'EOF'\n{original}\nEOF\nsystemctl reload docker")
    proc, data = deploy_json("--hosts", "spark01")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert ssh("spark01", f"systemctl is-active {UNIT}").stdout.strip() == "active"
