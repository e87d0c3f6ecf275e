"""Day-2 operations on the lab: status, start/stop with GPU hand-over, logs,
endpoints, recover (crash loop cleared; a hung GPU refused), bench."""
import csv
import json

import pytest

from lab import config
from tests.lab.conftest import deploy_json, invoke, ssh

OLLAMA = """[Unit]
Description=ollama stand-in (holds the GPU in real life)
[Service]
ExecStart=/bin/sleep infinity
"""
UNIT = "podman-vllm-diffusiongemma.service"


@pytest.fixture(scope="module")
def deployed(lab):
    # every host: the logs test reads a gateway's journal too (a lab whose disks are new has none yet)
    proc, _ = deploy_json()
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def test_status_shows_the_fleet_and_drift(deployed, lab_copy, tmp_path):
    out = tmp_path / "status.json"
    # the hosts this module deployed (on a fresh lab, hgx01 and the gateway may not be yet)
    proc = invoke("status", "--hosts", "spark01,rtx01,h100-01", "--json", out)
    data = json.loads(out.read_text())
    assert proc.returncode == 0 and data["ok"], proc.stdout
    for host in ("spark01", "rtx01", "h100-01"):
        h = data["hosts"][host]
        assert (h["unit_state"], h["container"], h["health"], h["drift"]) == ("active/running", "running", "200", [])
        assert h["digest"].startswith("sha256:") and h["image"].endswith(("-cu130",))
    assert data["hosts"]["h100-01"]["gpu_memory_used_mib"] > 0  # the stand-in holds what vLLM asked for
    defaults = {"canvas_length": 256, "max_denoising_steps": 48, "diffusion_sampler": "entropy_bound",
                "diffusion_entropy_bound": 0.1}
    for host in ("spark01", "rtx01", "h100-01"):  # the settings each replica runs with, from its command line
        assert [r["diffusion"] for r in data["hosts"][host]["replicas"]] == [defaults], data["hosts"][host]
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("max_num_seqs: 3\ndiffusion_entropy_bound: 0.2\n")
    invoke("status", "--hosts", "rtx01", "--json", out, inventory=lab_copy)
    rtx = json.loads(out.read_text())["hosts"]["rtx01"]
    # the roll, the front door's diffusion header for the replica (X-Dgemma-Diffusion) and the
    # replica's settings as the metrics label them (dgemma_replica_info)
    assert rtx["drift"] == ["service: rolling restart", "frontdoor: front door configuration",
                            "frontdoor: front door answering", "exporters: placement textfile"]
    # what runs, not what the inventory now says: the new bound is in force once it has rolled
    assert rtx["replicas"][0]["diffusion"] == defaults


def test_top_from_the_hosts_themselves_reads_every_replica(deployed):
    """`invoke top` without Prometheus: each serving host's program finds its replica units and
    asks each on the port its process listens on (day2/host_programs/serving_host.sh), on the
    docker host under qemu, the NixOS-like host and the one behind the bastion."""
    proc = invoke("top", "--hosts", "spark01,rtx01,h100-01", "--source", "hosts", "--json", "-", check=True)
    snap = json.loads(proc.stdout)
    rows = {(r["host"], r["replica"]): r for r in snap["replicas"]}
    assert set(rows) == {("spark01", 0), ("rtx01", 0), ("h100-01", 0)}, snap
    for row in rows.values():  # each answered its /metrics: vLLM's gauges, read
        assert row["up"] and row["running"] == 0 and row["kv_cache"] is not None, row
        assert row["model"] == "diffusiongemma", row
    assert snap["problems"] == [], snap["problems"]


def test_start_stops_conflicting_units_and_stop_resume_brings_them_back(deployed):
    ssh("rtx01", f"printf '{OLLAMA}' > /etc/systemd/system/ollama.service && systemctl daemon-reload")
    invoke("stop", "--hosts", "rtx01", check=True)
    ssh("rtx01", "systemctl start ollama.service")
    proc = invoke("start", "--hosts", "rtx01", check=True)
    assert "started: " in proc.stdout and "gate passed (the front door, its checks)" in proc.stdout
    assert ssh("rtx01", "systemctl is-active ollama.service", check=False).stdout.strip() == "inactive"
    invoke("stop", "--hosts", "rtx01", "--resume", check=True)
    assert ssh("rtx01", f"systemctl is-active {UNIT}", check=False).stdout.strip() == "inactive"
    assert ssh("rtx01", "systemctl is-active ollama.service").stdout.strip() == "active"
    invoke("start", "--hosts", "rtx01", check=True)
    assert ssh("rtx01", "systemctl is-active ollama.service", check=False).stdout.strip() == "inactive"
    assert "rolled: " in invoke("restart", "--hosts", "rtx01", check=True).stdout


def test_logs_are_prefixed_by_host(deployed):
    proc = invoke("logs", "--hosts", "rtx01,spark01", "--lines", "5", check=True)
    lines = [l for l in proc.stdout.splitlines() if l.strip()]
    assert any(l.startswith("rtx01   | ") for l in lines) and any(l.startswith("spark01 | ") for l in lines)
    # a gateway has no replica: the journal of the fleet's units it has (its HAProxy, its usage service:
    # what DgemmaUsageRecordsLost's fix asks for), each line naming its unit (several units asked: HAProxy's
    # health checks, a line a second, are most of the last lines)
    gateway = invoke("logs", "--hosts", "gateway01", "--lines", "20", check=True).stdout
    assert "podman-dgemma-gateway.service[" in gateway and "No entries" not in gateway, gateway


def test_endpoints_for_open_webui(deployed):
    key = config.API_KEY_FILE.read_text().strip()
    proc = invoke("endpoints", check=True)
    # one URL for Open WebUI: the gateways' shared address; each front door listed above it
    assert 'OPENAI_API_BASE_URLS="https://10.213.0.200:8000/v1"' in proc.stdout
    for url in ("https://10.213.0.11:8000/v1", "https://10.213.0.12:8000/v1", "https://10.213.1.13:8000/v1"):
        assert url in proc.stdout
    hosts_only = invoke("endpoints", "--hosts", "spark01,rtx01", check=True).stdout
    assert 'OPENAI_API_BASE_URLS="https://10.213.0.11:8000/v1;https://10.213.0.12:8000/v1"' in hosts_only
    assert key not in proc.stdout and "********" in proc.stdout
    assert key in invoke("endpoints", "--show-keys", check=True).stdout


def test_recover_clears_a_crash_loop(deployed):
    invoke("lab.gpu", "--host", "rtx01", "--held-mib", "20000", check=True)
    try:
        proc = invoke("restart", "--hosts", "rtx01")
        assert proc.returncode != 0 and "Free memory on device" in proc.stdout
        state = ssh("rtx01", f"systemctl is-active {UNIT}", check=False).stdout.strip()
        assert state in ("failed", "activating")
    finally:
        invoke("lab.gpu", "--host", "rtx01", "--clear", check=True)
    proc = invoke("recover", "--hosts", "rtx01", check=True)
    # one roll: drained, the unit stopped and reset, its processes killed, the container removed,
    # started, gated through the front door, back in service
    for said in ("GPU answers", "recover: podman-vllm-diffusiongemma.service recovered: drained in",
                 "unit stopped and reset", "container removed", "gate passed (the front door, its checks)"):
        assert said in proc.stdout, proc.stdout[-2000:]
    assert ssh("rtx01", f"systemctl is-active {UNIT}").stdout.strip() == "active"


def test_recover_refuses_to_touch_anything_when_nvidia_smi_hangs(deployed):
    before = ssh("rtx01", f"systemctl show -p MainPID --value {UNIT}").stdout.strip()
    invoke("lab.gpu", "--host", "rtx01", "--hang", check=True)
    try:
        proc = invoke("recover", "--hosts", "rtx01", "--set", "nvidia_smi_timeout=3")
    finally:
        invoke("lab.gpu", "--host", "rtx01", "--clear", check=True)
    assert proc.returncode != 0
    assert "GPU or its driver is wedged: reboot rtx01. Nothing was touched." in proc.stdout
    assert ssh("rtx01", f"systemctl show -p MainPID --value {UNIT}").stdout.strip() == before


def test_bench_writes_json_csv_and_the_table(deployed, tmp_path):
    js, cs = tmp_path / "bench.json", tmp_path / "bench.csv"
    proc = invoke("bench", "--hosts", "rtx01", "--json", js, "--csv", cs, "--repeats", "2", check=True)
    data = json.loads(js.read_text())
    figures = {f["scenario"]: f for f in data["hosts"][0]["figures"]}
    assert figures["full_canvas"]["mean_output_tokens"] == 256
    assert figures["short"]["mean_output_tokens"] < 64
    assert figures["full_canvas"]["tok_per_s"] > figures["short"]["tok_per_s"]  # cost is per canvas
    assert figures["concurrency_4"]["total_tokens"] == 1024 and figures["concurrency_4"]["errors"] == 0
    rows = list(csv.DictReader(cs.open()))
    assert {r["scenario"] for r in rows} == {"full_canvas", "short", "concurrency_4"}
    assert rows[0]["published"] == "700+"
    assert "per 256-token canvas" in proc.stdout
