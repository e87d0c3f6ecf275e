"""invoke deploy on the lab: from scratch, idempotent, check mode, failures that
stay on their host, host keys, the memory precheck, locks, a killed run."""
import json
import re
import shlex
import signal
import subprocess
import sys
import os
import time
import urllib.request

import pytest
import yaml

from lab import config
from tests.lab.conftest import ADDRESS, ROOT, deploy_json, front_door, invoke, ssh, ssh_args

UNIT = "/etc/systemd/system/podman-vllm-diffusiongemma.service"


def api_key():
    return config.API_KEY_FILE.read_text().strip()


def get(host, path, key=None, body=None):
    status, data, _ = front_door(host, path, key, body)
    return status, data


def recap(data):
    return {h: v["recap"] for h, v in data["hosts"].items()}


@pytest.fixture(scope="module")
def fresh_lab(lab):
    # from scratch: fresh disks for the hosts deployed from scratch here (the others keep what
    # they have: later modules deploy them as they are)
    invoke("lab.up", "--fresh-hosts", "spark01,rtx01", timeout=1800, check=True)
    return lab


def test_deploy_from_scratch_then_the_api_answers(fresh_lab):
    proc, data = deploy_json("--hosts", "spark01,rtx01")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    for host in ("spark01", "rtx01"):
        assert data["hosts"][host]["recap"]["failed"] == 0 and data["hosts"][host]["recap"]["changed"] > 0
        assert get(host, "/health")[0] == 200
        assert get(host, "/v1/models")[0] == 401
        status, body = get(host, "/v1/models", api_key())
        assert status == 200 and [m["id"] for m in json.loads(body)["data"]] == [
            "diffusiongemma", "nvidia/diffusiongemma-26B-A4B-it-NVFP4"]
    assert "ready: /health and /v1/models answer after" in proc.stdout
    assert api_key() not in proc.stdout + proc.stderr + json.dumps(data)


def test_vllms_open_routes_are_closed_at_the_front_door_and_answer_on_loopback(fresh_lab):
    """vLLM 0.33.0 registers routes outside its guarded prefixes that answer anyone with no
    key (/invocations runs a chat completion). At the host's address only the front door
    answers: those routes get 404, key or not. On loopback, the stand-in answers them as
    vLLM does, so this test would fail if the front door were gone."""
    chat = {"model": "nvidia/diffusiongemma-26B-A4B-it-NVFP4", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 8}
    probes = [("/invocations", chat), ("/scale_elastic_ep", {"new_data_parallel_size": 2}),
              ("/tokenize", {"prompt": "a b"}), ("/metrics", None)]
    for host in ("spark01", "rtx01"):
        for path, body in probes:
            assert get(host, path, body=body)[0] == 404, (host, path)
            assert get(host, path, api_key(), body=body)[0] == 404, (host, path)
        # vLLM itself listens on loopback only: nothing at the host's address on its port
        with pytest.raises(OSError):
            urllib.request.urlopen(f"http://{ADDRESS[host]}:8100/health", timeout=5)
    loopback = ssh("rtx01", "curl -s -o /dev/null -w '%{http_code} ' -H 'Content-Type: application/json' "
                            f"--data-binary {shlex.quote(json.dumps(chat))} http://127.0.0.1:8100/invocations; "
                            "curl -s -o /dev/null -w '%{http_code} ' http://127.0.0.1:8100/metrics; "
                            "curl -s -o /dev/null -w '%{http_code}' -H 'Content-Type: application/json' "
                            "--data-binary '{\"prompt\": \"a b\"}' http://127.0.0.1:8100/tokenize").stdout
    assert loopback.split() == ["200", "200", "200"], loopback
    # h100-01 is on the private network: people reach its front door through the bastion
    proc, _ = deploy_json("--hosts", "h100-01")
    assert proc.returncode == 0, proc.stdout[-3000:]
    through = subprocess.run([*ssh_args("bastion01"),
                              "curl -sk -o /dev/null -w '%{http_code}' -X POST https://10.213.1.13:8000/invocations; "
                              "echo; curl -sk -o /dev/null -w '%{http_code}' https://10.213.1.13:8000/health"],
                             text=True, capture_output=True, timeout=60).stdout
    assert through.split() == ["404", "200"], through


def test_second_deploy_changes_nothing(fresh_lab):
    proc, data = deploy_json("--hosts", "spark01,rtx01")
    assert proc.returncode == 0
    assert {h: r["changed"] for h, r in recap(data).items()} == {"spark01": 0, "rtx01": 0}


UNITS = {"spark01": "docker-vllm-diffusiongemma", "rtx01": "podman-vllm-diffusiongemma",
         "h100-01": "podman-vllm-diffusiongemma"}  # the runtime of each host, as in the shipped inventory


def test_host_var_edit_check_shows_diff_then_deploy_restarts_only_that_host(lab_copy):
    before = {h: ssh(h, f"systemctl show -p ActiveEnterTimestampMonotonic --value {UNITS[h]}")
              .stdout.strip() for h in ("spark01", "rtx01")}
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("max_num_seqs: 8\n")
    proc, data = deploy_json("--hosts", "spark01,rtx01", "--check", inventory=lab_copy)
    assert proc.returncode == 0
    assert re.search(r"^\s*\+ExecStart=.*--max-num-seqs 8", proc.stdout, re.M), proc.stdout[-3000:]
    assert "--max-num-seqs 4" in ssh("rtx01", f"cat {UNIT}").stdout  # nothing changed
    assert data["hosts"]["spark01"]["recap"]["changed"] == 0
    proc, data = deploy_json("--hosts", "spark01,rtx01", inventory=lab_copy)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert "--max-num-seqs 8" in ssh("rtx01", f"cat {UNIT}").stdout
    assert ssh("rtx01", f"cat {UNIT}.previous").stdout.count("--max-num-seqs 4") == 1
    after = {h: ssh(h, f"systemctl show -p ActiveEnterTimestampMonotonic --value {UNITS[h]}")
             .stdout.strip() for h in ("spark01", "rtx01")}
    assert after["spark01"] == before["spark01"] and after["rtx01"] != before["rtx01"]
    assert data["hosts"]["spark01"]["recap"]["changed"] == 0
    assert get("rtx01", "/v1/models", api_key())[0] == 200
    # back to the lab's own value for the tests after this one
    assert deploy_json("--hosts", "rtx01")[0].returncode == 0


def test_a_host_that_is_down_fails_alone(lab_copy):
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    hosts["all"]["children"]["h100"]["hosts"]["ghost01"] = {"ansible_host": "10.213.0.99", "connect_timeout": 3}
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    proc, data = deploy_json("--hosts", "ghost01,spark01,rtx01", inventory=lab_copy)
    assert proc.returncode != 0
    assert data["hosts"]["ghost01"]["recap"]["unreachable"] == 1
    assert "10.213.0.99" in data["hosts"]["ghost01"]["tasks"][0]["message"]
    assert data["hosts"]["spark01"]["recap"]["failed"] == 0 and data["hosts"]["rtx01"]["recap"]["failed"] == 0


def test_a_changed_host_key_is_refused_with_the_way_to_re_trust(lab_copy, tmp_path):
    known = tmp_path / "known_hosts"
    spark_key = (config.STATE / "hosts" / "spark01" / "root" / "etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
    known.write_text(f"{ADDRESS['rtx01']} {spark_key[0]} {spark_key[1]}\n")
    os.chmod(known, 0o600)
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    hosts["all"]["vars"]["known_hosts_file"] = str(known)
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    proc, data = deploy_json("--hosts", "rtx01", inventory=lab_copy)
    assert proc.returncode != 0
    message = data["hosts"]["rtx01"]["tasks"][0]["message"]
    assert "CHANGED" in message and "invoke trust --hosts rtx01" in message and "ssh-keygen -R" in message
    # an unknown host is refused too, and trust pins it only when asked
    known.write_text("")
    proc, data = deploy_json("--hosts", "rtx01", inventory=lab_copy)
    assert "not in known_hosts" in data["hosts"]["rtx01"]["tasks"][0]["message"]
    assert invoke("trust", "--hosts", "rtx01", "--yes", inventory=lab_copy).returncode == 0
    assert ADDRESS["rtx01"] in known.read_text()
    proc, data = deploy_json("--hosts", "rtx01", inventory=lab_copy)
    assert proc.returncode == 0


def test_memory_precheck_stops_a_busy_host_before_anything_starts(lab_copy):
    invoke("lab.gpu", "--host", "h100-01", "--held-mib", "40000", check=True)
    # deployed or not (an earlier test may have deployed it), the host is left as it was; its
    # service stopped: while our own vLLM runs, its memory is not free and the check waits for
    # a fresh start (start reports vLLM's refusal then)
    ssh("h100-01", f"systemctl stop {UNIT.rsplit('/', 1)[1]} 2>/dev/null; true")
    unit_before = ssh("h100-01", f"sha256sum {UNIT} 2>/dev/null; true").stdout
    try:
        (lab_copy / "group_vars" / "h100.yml").write_text("gpu_memory_utilization: 0.9\nautostart: true\n")
        proc, data = deploy_json("--hosts", "h100-01", inventory=lab_copy)
        assert proc.returncode != 0
        failed = [t for t in data["hosts"]["h100-01"]["tasks"] if t["status"] == "failed"]
        assert failed[0]["role"] == "preflight"
        assert "Free memory on device cuda:0" in failed[0]["message"] and "(pid 457, 40000 MiB)" in failed[0]["message"]
        assert ssh("h100-01", f"sha256sum {UNIT} 2>/dev/null; true").stdout == unit_before
        assert not any(t["status"] == "changed" for t in data["hosts"]["h100-01"]["tasks"])
    finally:
        invoke("lab.gpu", "--host", "h100-01", "--clear", check=True)


def test_two_deploys_to_one_host_the_second_waits_for_the_lock(lab, lab_copy):
    # the first changes the unit, so it restarts the service and takes seconds, not a fraction of one
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("max_num_seqs: 5\n")
    cmd = [sys.executable, "-m", "invoke", "deploy", "--hosts", "rtx01"]
    first = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, DGEMMA_INVENTORY=str(lab_copy), COLUMNS="200"),
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.5)
    second = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, DGEMMA_INVENTORY=str(lab), COLUMNS="200"),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    outs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert first.returncode == 0 and second.returncode == 0, outs
    assert any("waiting" in o and "for the lock held by" in o for o in outs), outs
    # and with no patience, it fails clearly
    holder = subprocess.Popen(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o",
                               f"UserKnownHostsFile={config.STATE}/ssh/known_hosts", "-i",
                               str(config.STATE / "ssh/id_ed25519"), f"root@{ADDRESS['rtx01']}",
                               "exec 9>>/run/lock/dgemma.lock; flock 9; echo test-holder > /run/lock/dgemma.lock.holder;"
                               # held until this end of the connection closes (its stdin ends): a remote
                               # `sleep` would hold it on after the kill below, and the next test wait for it
                               " echo held; timeout 60 cat >/dev/null"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    try:
        proc = invoke("deploy", "--hosts", "rtx01", "--lock-wait", "2", inventory=lab)
        assert proc.returncode != 0 and "kept its lock for more than 2 s" in proc.stdout
    finally:
        holder.kill()


def test_killed_mid_deploy_then_deploy_again_converges_with_no_half_written_file(lab_copy):
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("max_num_seqs: 6\n")
    env = dict(os.environ, DGEMMA_INVENTORY=str(lab_copy))
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", "--hosts", "rtx01"], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    # killed as the rolling restart begins (the step before it is done): the roll is one script on
    # the host that ends by itself, whatever happens to the control machine
    for line in proc.stdout:
        if "image in force" in line:
            proc.send_signal(signal.SIGKILL)
            break
    proc.wait(60)
    again, data = deploy_json("--hosts", "rtx01", inventory=lab_copy)
    assert again.returncode == 0, again.stdout[-3000:]
    assert "--max-num-seqs 6" in ssh("rtx01", f"cat {UNIT}").stdout
    leftovers = ssh("rtx01", "ls -A /etc/systemd/system /etc/dgemma /var/lib/dgemma | grep '^\\.' || true").stdout
    assert leftovers.strip() == ""
    assert get("rtx01", "/v1/models", api_key())[0] == 200
    assert deploy_json("--hosts", "rtx01")[0].returncode == 0  # back to the lab's values
