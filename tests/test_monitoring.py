"""The monitoring stack's files as deploy renders them, checked by the programs that read
them (Debian's, the versions the lab's images run): the rules by their unit tests (promtool
test rules, tests/monitoring/rules-test.yml), Prometheus's configuration by promtool,
Alertmanager's by amtool; what each host serves for discovery; the textfiles."""
import json
import shutil
import subprocess

import pytest
import yaml

from serving import scrape_targets
from roles.exporters import textfiles
from serving.fleet import fleet_of
from serving.handoffs import UnitPlan
from serving.replicas import Served, replica
from roles.monitoring import alertmanager, prometheus, rules
from tests.conftest import ROOT

TESTS = ROOT / "tests" / "monitoring"
HOSTS = {
    "rtx01": {"ansible_host": "10.213.0.12", "group_names": ["rtx"]},
    "h100-01": {"ansible_host": "10.213.1.13", "group_names": ["h100"]},
    "gateway01": {"ansible_host": "10.213.0.110", "group_names": ["gateway"]},
    "monitor01": {"ansible_host": "10.213.0.112", "group_names": ["monitoring"]},
}


def tool(name):
    if not shutil.which(name):
        pytest.fail(f"{name} is not installed: ./run.sh test installs it (Debian's prometheus and "
                    f"prometheus-alertmanager)")
    return name


def test_the_rules_pass_their_unit_tests(tmp_path):
    (tmp_path / "rules.yml").write_text(rules.render({}))
    shutil.copy(TESTS / "rules-test.yml", tmp_path)
    proc = subprocess.run([tool("promtool"), "test", "rules", "rules-test.yml"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr


def test_a_threshold_from_the_inventory_changes_its_rule_and_keeps_the_others(tmp_path):
    text = rules.render({"alert_thresholds": {"ttft_p95_seconds": 2.5, "waiting_seconds": 30}})
    alerts = {r["alert"]: r for g in yaml.safe_load(text)["groups"] for r in g["rules"]}
    assert alerts["DgemmaSlowFirstToken"]["expr"].rstrip().endswith("> 2.5")
    assert "vllm:num_requests_waiting[30s]" in alerts["DgemmaRequestsWaiting"]["expr"]
    assert alerts["DgemmaKvCacheNearlyFull"]["expr"].endswith("> 0.9")  # the default stays
    assert all(a["annotations"]["fix"].startswith("invoke ") or "invoke " in a["annotations"]["fix"]
               for a in alerts.values()), "every alert names a command"
    (tmp_path / "rules.yml").write_text(text)
    proc = subprocess.run([tool("promtool"), "check", "rules", str(tmp_path / "rules.yml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_the_prometheus_configuration_loads_and_scrapes_every_host_through_its_front_door(tmp_path):
    fleet = fleet_of(HOSTS)
    remote = [{"url": "https://mimir.example.com/api/v1/push", "bearer_token": f"{tmp_path}/secrets/remote-write-0"}]
    text = prometheus.render("monitor01", {"prometheus_port": 9090, **HOSTS["monitor01"]}, fleet, remote,
                             files=str(tmp_path))
    (tmp_path / "prometheus.yml").write_text(text)
    for name in ("monitoring.key", "ca.crt", "secrets/remote-write-0", prometheus.TARGETS_FILE):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("x\n")
    (tmp_path / prometheus.TARGETS_FILE).write_text(prometheus.render_targets(fleet))
    (tmp_path / prometheus.RULES_FILE).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / prometheus.RULES_FILE).write_text(rules.render({}))
    proc = subprocess.run([tool("promtool"), "check", "config", str(tmp_path / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(text)
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    # the serving hosts' replicas: asked of each serving host (not of the gateway, not of itself)
    assert [sd["url"] for sd in jobs["fleet-replicas"]["http_sd_configs"]] == \
        ["https://10.213.0.12:8000/metrics/sd", "https://10.213.1.13:8000/metrics/sd"]
    for job in ("fleet-hosts", "fleet-replicas"):  # https, the fleet CA, the monitoring key
        assert jobs[job]["scheme"] == "https" and jobs[job]["tls_config"]["ca_file"] == f"{tmp_path}/ca.crt"
        assert jobs[job]["authorization"]["credentials_file"] == f"{tmp_path}/monitoring.key"
    targets = json.loads((tmp_path / prometheus.TARGETS_FILE).read_text())
    seen = {(g["labels"]["host"], g["labels"]["job"], g["labels"]["__metrics_path__"]): g["targets"] for g in targets}
    assert seen == {("rtx01", "frontdoor", "/metrics/haproxy"): ["10.213.0.12:8000"],
                    ("rtx01", "node", "/metrics/node"): ["10.213.0.12:8000"],
                    ("h100-01", "frontdoor", "/metrics/haproxy"): ["10.213.1.13:8000"],
                    ("h100-01", "node", "/metrics/node"): ["10.213.1.13:8000"],
                    ("gateway01", "gateway", "/metrics/haproxy"): ["10.213.0.110:8000"],
                    ("gateway01", "node", "/metrics/node"): ["10.213.0.110:8000"],
                    ("gateway01", "usage", "/metrics/usage"): ["10.213.0.110:8000"]}
    local = jobs["monitoring"]["static_configs"]
    assert {g["labels"]["job"] for g in local} == {"prometheus", "alertmanager", "node"}
    assert all(t.startswith("127.0.0.1:") for g in local for t in g["targets"])
    assert config["remote_write"] == [{"url": "https://mimir.example.com/api/v1/push", "authorization": {
        "type": "Bearer", "credentials_file": f"{tmp_path}/secrets/remote-write-0"}}]


def test_a_host_that_serves_and_gateways_and_monitors_is_scraped_once_per_source():
    """hgx01 listed in hgx, gateway and monitoring: its front door (moved to 8001) has its node
    exporter and replicas, its gateway (8000) its HAProxy and usage, and Prometheus there does not
    scrape its node exporter a second time on loopback."""
    hosts = {"rtx01": {"ansible_host": "10.213.0.12", "group_names": ["rtx"], "direct_group_names": ["rtx"]},
             "hgx01": {"ansible_host": "10.213.0.109", "group_names": ["gateway", "hgx", "monitoring"],
                       "direct_group_names": ["hgx", "gateway", "monitoring"]}}
    fleet = fleet_of(hosts)
    seen = {(g["labels"]["host"], g["labels"]["job"], g["labels"]["__metrics_path__"]): g["targets"]
            for g in json.loads(prometheus.render_targets(fleet))}
    assert seen == {("rtx01", "frontdoor", "/metrics/haproxy"): ["10.213.0.12:8000"],
                    ("rtx01", "node", "/metrics/node"): ["10.213.0.12:8000"],
                    ("hgx01", "frontdoor", "/metrics/haproxy"): ["10.213.0.109:8001"],
                    ("hgx01", "node", "/metrics/node"): ["10.213.0.109:8001"],
                    ("hgx01", "gateway", "/metrics/haproxy"): ["10.213.0.109:8000"],
                    ("hgx01", "usage", "/metrics/usage"): ["10.213.0.109:8000"]}
    config = yaml.safe_load(prometheus.render("hgx01", hosts["hgx01"], fleet, []))
    jobs = {c["job_name"]: c for c in config["scrape_configs"]}
    assert [sd["url"] for sd in jobs["fleet-replicas"]["http_sd_configs"]] == \
        ["https://10.213.0.12:8000/metrics/sd", "https://10.213.0.109:8001/metrics/sd"]
    assert {g["labels"]["job"] for g in jobs["monitoring"]["static_configs"]} == {"prometheus", "alertmanager"}


def test_alertmanager_takes_each_kind_of_receiver_with_its_secret_in_a_file(tmp_path):
    v = {"alert_receivers": [
        {"name": "ops", "webhook": {"url": "http://10.213.0.1:9099/alerts", "bearer_token_file": "/keys/hook"}},
        {"name": "oncall", "min_severity": "critical", "slack": {"api_url_file": "/keys/slack", "channel": "#gpu"},
         "email": {"to": "gpu@lab.example", "from": "fleet@lab.example", "smarthost": "smtp.lab.example:587",
                   "username": "fleet", "password_file": "/keys/smtp"}}]}
    text = alertmanager.render(v, files=str(tmp_path))
    (tmp_path / "alertmanager.yml").write_text(text)
    proc = subprocess.run([tool("amtool"), "check-config", str(tmp_path / "alertmanager.yml")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
    config = yaml.safe_load(text)
    assert [r["receiver"] for r in config["route"]["routes"]] == ["ops", "oncall"]
    assert config["route"]["routes"][1]["matchers"] == ['severity="critical"']
    receivers = {r["name"]: r for r in config["receivers"]}
    assert receivers["ops"]["webhook_configs"][0]["send_resolved"] is True
    assert receivers["oncall"]["slack_configs"][0]["api_url_file"] == f"{tmp_path}/secrets/oncall-slack-url"
    assert receivers["oncall"]["email_configs"][0]["auth_password_file"] == f"{tmp_path}/secrets/oncall-smtp-password"
    assert "/keys/" not in text  # the control machine's paths stay there: the host's copies are named
    assert alertmanager.secrets(v) == [("ops", "webhook-token", "/keys/hook"), ("oncall", "slack-url", "/keys/slack"),
                                       ("oncall", "smtp-password", "/keys/smtp")]


def test_a_host_lists_its_replicas_with_their_model_gpus_and_path():
    replicas = [{"index": 1, "family": "gemma4", "model": "google/gemma-4-26B-A4B-it", "gpus": ["GPU-b", "GPU-c"]},
                {"index": 0, "family": "diffusiongemma", "model": "google/diffusiongemma-26B-A4B-it", "gpus": ["GPU-a"]}]
    served = [Served(replica({}, r["index"], r["family"], r["gpus"]), r["model"], 0.9) for r in replicas]
    groups = scrape_targets.host_targets("hgx01", {"ansible_host": "10.213.0.109", "api_port": 8443}, served,
                                         dcgm=True)
    assert [g["labels"]["job"] for g in groups] == ["frontdoor", "node", "gpu", "vllm", "vllm"]
    assert all(g["targets"] == ["10.213.0.109:8443"] for g in groups)
    assert groups[4]["labels"] == {"job": "vllm", "__metrics_path__": "/metrics/replica/1", "host": "hgx01",
                                   "instance": "hgx01/1", "replica": "1", "model": "gemma4",
                                   "variant": "google/gemma-4-26B-A4B-it", "gpu_uuid": "GPU-b,GPU-c"}
    assert scrape_targets.replicas_of(scrape_targets.parse(scrape_targets.render(groups))) == \
        sorted(replicas, key=lambda r: r["index"])
    assert scrape_targets.address("x", {"ansible_host": "fd00::5"}) == "[fd00::5]:8000"


def test_the_textfiles_say_which_gpu_serves_which_replica_and_why_one_is_left_out(tmp_path):
    gpus = [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}]
    first = replica({}, 0, gpus=["GPU-a"])
    text = textfiles.placement(gpus, [UnitPlan(Served(first, "nvidia/x", 0.7), "diffusiongemma", ("diffusiongemma",),
                                               first.unit_path, "")],
                               [{"uuid": "GPU-b", "reason": 'busy: "python3" holds 40000 MiB'}],
                               {0: {"canvas_length": 256, "max_denoising_steps": 48, "diffusion_sampler": "entropy_bound",
                                    "diffusion_entropy_bound": 0.1}})
    text += textfiles.certificates({"frontdoor": 1.8e9, "ca": 2.1e9})
    assert 'dgemma_gpu_placed{gpu="1",UUID="GPU-b",replica="",model="",reason="busy: \\"python3\\" holds 40000 MiB"} 0' \
        in text
    assert 'dgemma_replica_info{replica="0",model="diffusiongemma",variant="nvidia/x",gpu_uuid="GPU-a",' \
           'unit="podman-vllm-diffusiongemma.service",canvas_length="256",max_denoising_steps="48",' \
           'diffusion_sampler="entropy_bound",diffusion_entropy_bound="0.1"} 1' in text
    assert 'dgemma_tls_certificate_expiry_timestamp_seconds{certificate="frontdoor"} 1800000000' in text
    proc = subprocess.run([tool("promtool"), "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=60)
    assert "error" not in (proc.stdout + proc.stderr).lower(), proc.stdout + proc.stderr


def test_the_gpu_collector_writes_dcgms_names_from_the_real_h100s_answer(tmp_path):
    """roles/exporters/files/collector.sh fed the real H100's answer to its query (captured with
    what it wrote there): the same series, the same values; a [N/A] field is left out, a
    failing nvidia-smi says so (dgemma_gpu_collector_up 0) instead of writing half a file."""
    capture = ROOT / "tests" / "fixtures" / "nvidia-smi" / "h100"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    smi = bindir / "nvidia-smi"
    answer = tmp_path / "answer.csv"

    def collect(text, rc=0):
        answer.write_text(text)
        smi.write_text(f"#!/bin/sh\ncat {answer}\nexit {rc}\n")
        smi.chmod(0o755)
        env = {"PATH": f"{bindir}:/usr/bin:/bin", "DGEMMA_ONCE": "1", "DGEMMA_TEXTFILES": str(tmp_path / "out"),
               "DGEMMA_WEIGHTS": str(tmp_path), "DGEMMA_FRONTDOOR_SOCKET": str(tmp_path / "none.sock")}
        subprocess.run(["sh", str(ROOT / "roles" / "exporters" / "files" / "collector.sh")], env=env, check=True, timeout=60)
        return (tmp_path / "out" / "gpu.prom").read_text()

    def series(text):
        return sorted(line.replace('Hostname="vm"', "") for line in text.splitlines()
                      if line and not line.startswith(("#", "dgemma_gpu_collector_duration",
                                                       "dgemma_gpu_collector_last_run")))

    got = collect((capture / "collector-query.csv").read_text())
    # the host's reading and the capture of its query are two samples apart: the power moved
    # (71.24 W there, 71.26 W in the query); every other series and value is the host's
    mine = series(got.replace(f'Hostname="{__import__("socket").gethostname()}"', ""))
    theirs = series((capture / "collector-gpu.prom").read_text())
    assert [line for line in mine if "POWER_USAGE" not in line] == [line for line in theirs if "POWER_USAGE" not in line]
    assert [line.rsplit(" ", 1)[1] for line in mine if "POWER_USAGE" in line] == ["71.26"]
    assert "DCGM_FI_DEV_CLOCKS_EVENT_REASONS{" in got and got.count("dgemma_gpu_collector_up 1") == 1
    gb10 = "0, GPU-9b10, NVIDIA GB10, 0000000F:01:00.0, 580.126.09, 37, 0, [N/A], [N/A], [N/A], 41, [N/A], 4.20, [N/A], 208, 3003, 0x0000000000000001\n"
    text = collect(gb10)
    assert "DCGM_FI_DEV_GPU_UTIL{" in text and "DCGM_FI_DEV_FB_USED" not in text and "POWER_MGMT_LIMIT" not in text
    failed = collect("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n", rc=9)
    assert "dgemma_gpu_collector_up 0" in failed and "DCGM_FI_DEV_GPU_UTIL" not in failed
