"""invoke verify on the lab: all green after a deploy; one broken thing on one
host fails exactly that check there, with what to run to fix it."""
import json

import pytest

from tests.lab.conftest import deploy_json, invoke, ssh

HOSTS = "spark01,rtx01,h100-01"


def verify(tmp_path, *args, hosts=HOSTS):
    out = tmp_path / f"verify-{len(list(tmp_path.iterdir()))}.json"
    junit = tmp_path / "junit.xml"
    proc = invoke("verify", "--hosts", hosts, "--json", out, "--junit", junit, *args)
    return proc, json.loads(out.read_text()), junit


def failures(data):
    return {(h, c["check"]): c["message"] for h, e in data["hosts"].items() for c in e["checks"]
            if c["status"] == "failed"}


@pytest.fixture(scope="module")
def deployed(lab):
    proc, data = deploy_json("--hosts", HOSTS)
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def test_verify_passes_on_every_host_after_deploy(deployed, tmp_path):
    proc, data, junit = verify(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert data["ok"] and failures(data) == {}
    for host in HOSTS.split(","):
        checks = {c["check"] for c in data["hosts"][host]["checks"] if c["status"] == "passed"}
        assert {"service: environment_file_is_0600_root", "image: image_matches_arch_cuda_and_recorded_digest",
                "weights: weights_snapshot_complete", "start: tool_call_is_well_formed"} <= checks
    assert "<testsuite" in junit.read_text()


BROKEN = [
    ("rtx01", "chmod 644 /etc/dgemma/vllm-diffusiongemma.env", "service: environment_file_is_0600_root"),
    ("h100-01", "systemctl stop podman-vllm-diffusiongemma", "start: service_running_as_declared"),
    ("rtx01", "podman pull -q 10.213.0.1:5000/vllm/vllm-openai:gemma-aarch64-cu130 >/dev/null 2>&1 && "
              "podman tag 10.213.0.1:5000/vllm/vllm-openai:gemma-aarch64-cu130 "
              "10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130",
     "image: image_matches_arch_cuda_and_recorded_digest"),
    ("spark01", "cd /srv/models/hf-cache/hub/models--*/blobs && rm -f $(ls | grep -E '^[0-9a-f]{64}$' | head -n 1)",
     "weights: weights_snapshot_complete"),
]


def test_each_broken_thing_fails_exactly_its_check_then_deploy_fixes_them(deployed, tmp_path):
    """Four things broken on three hosts at once (each a check of its own): verify fails exactly
    those four checks, each saying what to run; one deploy of the three hosts fixes them all."""
    for host, break_it, _ in BROKEN:
        ssh(host, break_it, timeout=300)
    proc, data, _ = verify(tmp_path)
    assert proc.returncode != 0
    found = failures(data)
    assert sorted(found) == sorted((host, check) for host, _, check in BROKEN), found
    for (host, check), message in found.items():
        assert f"invoke deploy --hosts {host}" in message, (host, check, message)
    assert deploy_json("--hosts", HOSTS)[0].returncode == 0
    proc, data, _ = verify(tmp_path)
    assert proc.returncode == 0 and failures(data) == {}, failures(data)


def test_an_unreachable_host_is_a_failure_of_that_host(deployed, lab_copy, tmp_path):
    import yaml
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    hosts["all"]["children"]["h100"]["hosts"]["ghost01"] = {"ansible_host": "10.213.0.99", "connect_timeout": 3}
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    out = tmp_path / "v.json"
    proc = invoke("verify", "--hosts", "ghost01,rtx01", "--json", out, inventory=lab_copy)
    data = json.loads(out.read_text())
    assert proc.returncode == 1
    assert not data["hosts"]["ghost01"]["ok"] and data["hosts"]["rtx01"]["ok"]
