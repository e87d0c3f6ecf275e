"""Every GPU of a machine serves: hgx01 carries four GPU stand-ins (two of the real
H200 captures, two built in their format). One vLLM replica per GPU, each its own
unit, loopback port and GPU by uuid, behind the host's one front door: DiffusionGemma
on GPUs 0 and 1, Gemma 4 on 2 and 3 (lab/inventory.py)."""
import json

import pytest

from lab import config
from tests.lab.conftest import deploy_json, front_door, invoke, ssh

HOST = "hgx01"
UUIDS = ["GPU-c4e45dc5-923e-4dd7-b871-0c1b63d1157c", "GPU-4d5f8a85-15cf-7668-0fc3-bb5cece760ec",
         "GPU-b1117000-0000-4000-8000-000000000002", "GPU-b1117000-0000-4000-8000-000000000003"]
# each replica's unit and container say the family it serves
UNITS = ["podman-vllm-diffusiongemma.service", "podman-vllm-diffusiongemma-1.service", "podman-vllm-gemma4-2.service",
         "podman-vllm-gemma4-3.service"]
CONTAINERS = ["vllm-diffusiongemma", "vllm-diffusiongemma-1", "vllm-gemma4-2", "vllm-gemma4-3"]
UNIT_DIR = "/etc/systemd/system"


def active(units):
    out = ssh(HOST, "systemctl is-active " + " ".join(units), check=False).stdout.split()
    return dict(zip(units, out))


def seen_gpus(container):
    out = ssh(HOST, f"podman exec {container} nvidia-smi -L").stdout
    return [line.rsplit("UUID: ", 1)[1].rstrip(")") for line in out.splitlines() if "UUID: " in line]


def tasks_of(data):
    return data["hosts"][HOST]["tasks"]


def changed(data):
    return [f"{t['role']}: {t['task']}" for t in tasks_of(data) if t["status"] == "changed"]


@pytest.fixture(scope="module")
def four(lab):
    invoke("lab.gpu", "--host", HOST, "--clear", check=True)
    proc, data = deploy_json("--hosts", HOST)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return data


def test_four_replicas_each_on_its_own_gpu_behind_one_front_door(four, tmp_path):
    assert set(active(UNITS).values()) == {"active"}
    # each container sees exactly the GPU it was handed, by uuid, numbered 0 inside
    assert [seen_gpus(c) for c in CONTAINERS] == [[u] for u in UUIDS]
    # each replica on its own loopback port, nothing on the network
    listening = ssh(HOST, "ss -Hltn | awk '{print $4}'").stdout.split()
    assert {f"127.0.0.1:{8100 + i}" for i in range(4)} <= set(listening)
    assert not [a for a in listening if a.endswith(tuple(f":{8100 + i}" for i in range(4))) and
                not a.startswith("127.0.0.1:")]
    # the front door balances the four; users see one address
    haproxy = ssh(HOST, "cat /etc/dgemma/frontdoor/haproxy.cfg").stdout
    servers = haproxy.split("\nbackend servers\n", 1)[1].split("\nbackend ", 1)[0]
    assert [line.split()[1:3] for line in servers.splitlines() if line.strip().startswith("server replica")] == \
        [[f"replica{i}", f"127.0.0.1:{8100 + i}"] for i in range(4)]
    assert "    server flag 127.0.0.1:9 disabled" in haproxy.splitlines()  # a roll's flag, never checked
    code, body, _ = front_door(HOST, "/v1/models", key=config.API_KEY_FILE.read_text().strip())
    assert code == 200, body[:300]
    # the plan as `invoke facts` shows it
    out = tmp_path / "facts.json"
    invoke("facts", "--hosts", HOST, "--json", out, check=True)
    choice = json.loads(out.read_text())["hosts"][HOST]["choice"]
    assert [(r["gpus"], r["port"], r["tensor_parallel_size"]) for r in choice["replicas"]] == \
        [([u], 8100 + i, 1) for i, u in enumerate(UUIDS)]
    assert choice["skipped_gpus"] == []


def test_verify_runs_every_check_on_every_replica(four, tmp_path):
    out = tmp_path / "verify.json"
    proc = invoke("verify", "--hosts", HOST, "--json", out)
    data = json.loads(out.read_text())
    assert proc.returncode == 0 and data["ok"], proc.stdout[-3000:]
    checks = {c["check"]: c["status"] for c in data["hosts"][HOST]["checks"]}
    assert checks["start: each_replica_sees_only_its_gpus"] == "passed"
    assert checks["service: no_replica_left_that_is_not_planned"] == "passed"
    assert checks["start: chat_completion_without_thinking"] == "passed"


def test_status_and_day2_per_replica(four, tmp_path):
    out = tmp_path / "status.json"
    invoke("status", "--hosts", HOST, "--json", out, check=True)
    replicas = json.loads(out.read_text())["hosts"][HOST]["replicas"]
    assert [(r["replica"], r["unit_state"], r["container"], r["health"], r["gpus"]) for r in replicas] == \
        [(i, "active/running", "running", "200", [i]) for i in range(4)]
    before = ssh(HOST, f"systemctl show -p MainPID --value {UNITS[0]} {UNITS[3]}").stdout.split()
    invoke("restart", "--hosts", HOST, "--replica", "1", check=True)
    assert ssh(HOST, f"systemctl show -p MainPID --value {UNITS[0]} {UNITS[3]}").stdout.split() == before
    logs = invoke("logs", "--hosts", HOST, "--replica", "1", "--lines", "3", check=True).stdout
    assert [line for line in logs.splitlines() if line.startswith(f"{HOST} | ")]
    # bench: the host over its front door, then each replica alone
    js, cs = tmp_path / "bench.json", tmp_path / "bench.csv"
    invoke("bench", "--hosts", HOST, "--json", js, "--csv", cs, "--repeats", "1", "--concurrency", "2", check=True)
    benched = json.loads(js.read_text())["hosts"]
    # each model apart (hgx01 serves both: lab/inventory.py)
    assert [(b["replica"], b["model"]) for b in benched] == [
        (None, "diffusiongemma"), (None, "gemma4"), (0, "diffusiongemma"), (1, "diffusiongemma"), (2, "gemma4"),
        (3, "gemma4")]
    assert all(f["errors"] == 0 and f["mean_output_tokens"] > 0 for b in benched for f in b["figures"])
    wrong = invoke("stop", "--hosts", HOST, "--replica", "7")
    assert wrong.returncode != 0 and "has no replica 7 (it has 0, 1, 2, 3)" in wrong.stdout + wrong.stderr
    # logs checks it too, where it printed "-- No entries --" and succeeded
    nothing = invoke("logs", "--hosts", HOST, "--replica", "7")
    assert nothing.returncode == 1 and f"{HOST} | {HOST} has no replica 7 (it has 0, 1, 2, 3)" in nothing.stdout, \
        nothing.stdout + nothing.stderr
    assert set(active(UNITS).values()) == {"active"}


def test_a_busy_gpu_drops_its_replica_alone_and_it_comes_back(four):
    """Someone stops replica 2 to run a job that holds 40 GiB on GPU 2: the next deploy
    runs three replicas and says why; the job done, the fourth comes back; then nothing
    is left to do."""
    pids = ssh(HOST, f"systemctl show -p MainPID --value {UNITS[0]} {UNITS[1]} {UNITS[3]}").stdout.split()
    invoke("stop", "--hosts", HOST, "--replica", "2", check=True)
    invoke("lab.gpu", "--host", HOST, "--gpu", "2", "--held-mib", "40000", check=True)
    try:
        proc, data = deploy_json("--hosts", HOST)
        assert proc.returncode == 0, proc.stdout[-3000:]
        left_out = [t["message"] for t in tasks_of(data) if t["task"] == "GPUs left out"]
        assert left_out and f"GPU 2 ({UUIDS[2]}) left out: vLLM would refuse to start on GPU 2" in left_out[0]
        assert "service: replica 2 removed" in changed(data)
        assert ssh(HOST, f"test -e {UNIT_DIR}/{UNITS[2]} || echo gone").stdout.strip() == "gone"
        # the other three were not touched
        assert ssh(HOST, f"systemctl show -p MainPID --value {UNITS[0]} {UNITS[1]} {UNITS[3]}").stdout.split() == pids
        haproxy = ssh(HOST, "cat /etc/dgemma/frontdoor/haproxy.cfg").stdout
        assert "server replica2 " not in haproxy and "server replica3 127.0.0.1:8103" in haproxy
    finally:
        invoke("lab.gpu", "--host", HOST, "--clear", check=True)
    proc, data = deploy_json("--hosts", HOST)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert set(active(UNITS).values()) == {"active"} and seen_gpus(CONTAINERS[2]) == [UUIDS[2]]
    proc, data = deploy_json("--hosts", HOST)
    assert proc.returncode == 0 and changed(data) == [], changed(data)


def test_a_host_of_the_previous_release_converges_to_replicas(four):
    """One unit that handed over every GPU (the previous release), the replica units gone:
    one deploy rewrites it onto GPU 0 alone and adds the other three."""
    unit = f"{UNIT_DIR}/{UNITS[0]}"
    ssh(HOST, "systemctl disable --now " + " ".join(UNITS[1:]) + "; rm -f " +
        " ".join(f"{UNIT_DIR}/{u}" for u in UNITS[1:]) +
        f"; sed -i 's|--device nvidia.com/gpu={UUIDS[0]}|--device nvidia.com/gpu=all|' {unit}"
        f" && systemctl daemon-reload && systemctl restart {UNITS[0]}")
    assert "nvidia.com/gpu=all" in ssh(HOST, f"cat {unit}").stdout
    proc, data = deploy_json("--hosts", HOST)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert set(active(UNITS).values()) == {"active"}
    assert [seen_gpus(c) for c in CONTAINERS] == [[u] for u in UUIDS]
    assert "nvidia.com/gpu=all" not in ssh(HOST, f"cat {unit}").stdout
    proc, data = deploy_json("--hosts", HOST)
    assert proc.returncode == 0 and changed(data) == [], changed(data)


def test_serial_batches_stop_after_a_failed_host(four, lab_copy):
    """--serial 1: rtx01 first (its inventory names a GPU it has not), then hgx01, which a
    failed batch leaves not started; --max-fail 1 lets the run go on."""
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("gpus: [3]\n")
    proc, data = deploy_json("--hosts", "rtx01,hgx01", "--serial", "1", "--check", inventory=lab_copy)
    assert proc.returncode == 1
    assert "batch 1 of 2" in proc.stdout and data["halted"].startswith("1 of 1 hosts of batch 1 failed (rtx01")
    assert [t["task"] for t in data["hosts"]["hgx01"]["tasks"]] == ["not started"]
    proc, data = deploy_json("--hosts", "rtx01,hgx01", "--serial", "1", "--max-fail", "1", "--check",
                             inventory=lab_copy)
    assert proc.returncode == 1 and "halted" not in data
    assert data["hosts"]["hgx01"]["recap"]["failed"] == 0 and len(data["hosts"]["hgx01"]["tasks"]) > 5


def test_render_prints_a_unit_per_replica_or_one_module(four):
    units = invoke("render", "--hosts", HOST, check=True).stdout
    assert [line.split(": ", 1)[1] for line in units.splitlines() if line.startswith("# ---- ")] == \
        [f"{UNIT_DIR}/{u}" for u in UNITS]
    assert ssh(HOST, f"cat {UNIT_DIR}/{UNITS[2]}").stdout in units  # what deploy wrote, byte for byte
    module = invoke("render", "--hosts", HOST, "--format", "nixos", check=True).stdout
    assert module.count("# ---- ") == 1 and all(f'containers."{c}"' in module for c in CONTAINERS)
