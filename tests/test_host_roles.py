"""What `invoke inventory.check` says each host is for: serving (its models and GPUs), gateway
(and its turn at the shared address), monitoring; a gateway listed in a serving group serves too,
and a model entry a deploy would refuse fails the check with its file and line."""
import subprocess
import sys

from serving.host_roles import host_roles
from tests.conftest import ROOT


def test_each_host_is_shown_as_the_roles_read_it():
    hostvars = {
        "spark01": {"group_names": ["spark"]},
        "hgx01": {"group_names": ["hgx"], "models": [{"family": "diffusiongemma", "gpus": 2},
                                                     {"family": "gemma4"}]},
        "h200": {"group_names": ["hgx"], "models": [{"family": "diffusiongemma", "gpus": [1]}]},
        "gateway01": {"group_names": ["gateway"], "gateway_address": "10.0.0.200"},
        "gateway02": {"group_names": ["gateway", "monitoring"], "gateway_address": "10.0.0.200"},
        "gateway03": {"group_names": ["gateway"], "gateway_address": "10.0.0.200"},
        "monitor01": {"group_names": ["monitoring"]},
    }
    shown = {r.host: (r.roles, r.problem) for r in host_roles(hostvars)}
    assert shown == {
        "spark01": (("serves diffusiongemma",), None),
        "hgx01": (("serves diffusiongemma on 2 GPUs, gemma4 on the GPUs left",), None),
        "h200": (("serves diffusiongemma on GPU 1",), None),
        "gateway01": (("gateway, first to hold 10.0.0.200",), None),
        "gateway02": (("gateway, second in line for 10.0.0.200 (after gateway01)",
                       "monitoring (Prometheus, Alertmanager)"), None),
        "gateway03": (("gateway, third in line for 10.0.0.200 (after gateway01, gateway02)",), None),
        "monitor01": (("monitoring (Prometheus, Alertmanager)",), None),
    }
    alone = host_roles({"gw": {"group_names": ["gateway"]}})
    assert alone[0].roles == ("gateway (no shared address: clients use its own)",)


def test_a_gateway_listed_in_a_serving_group_serves_too_and_a_parent_group_serves_nothing():
    # rtx01 listed by rtx and gateway; gateway01 by gateway alone (lab is gateway's parent)
    hostvars = {"rtx01": {"group_names": ["lab", "rtx", "gateway"], "direct_group_names": ["rtx", "gateway"]},
                "gateway01": {"group_names": ["lab", "gateway"], "direct_group_names": ["gateway"]},
                "hgx01": {"group_names": ["hgx", "monitoring"], "direct_group_names": ["hgx", "monitoring"],
                          "frontdoor_port": 9443}}
    rtx01, gateway01, hgx01 = host_roles(hostvars)
    assert rtx01.roles == ("serves diffusiongemma (its front door on port 8001)",
                           "gateway (no shared address: clients use its own)")
    assert gateway01.roles == ("gateway (no shared address: clients use its own)",)
    assert hgx01.roles == ("serves diffusiongemma", "monitoring (Prometheus, Alertmanager)")


def _check(inv):
    return subprocess.run([sys.executable, "-m", "invoke", "inventory.check", "--inventory", str(inv)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


def test_inventory_check_lists_each_hosts_roles_and_refuses_a_model_entry_with_its_line(tmp_path):
    inv = tmp_path / "inventory"
    (inv / "host_vars").mkdir(parents=True)
    (inv / "hosts.yml").write_text(
        "all:\n  children:\n    rtx:\n      hosts:\n        rtx01: {ansible_host: 10.0.0.2}\n"
        "        rtx02: {ansible_host: 10.0.0.3}\n"
        "    gateway:\n      vars:\n        gateway_address: 10.0.0.200\n      hosts:\n"
        "        gw01: {ansible_host: 10.0.0.4}\n        rtx02:\n")
    proc = _check(inv)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[1:] == [
        "  rtx01  serves diffusiongemma",
        "  rtx02  serves diffusiongemma (its front door on port 8001); gateway, first to hold 10.0.0.200",
        "  gw01   gateway, second in line for 10.0.0.200 (after rtx02)",
    ], proc.stdout  # the gateways' turns follow the inventory's order of hosts, as keepalived's priorities do
    (inv / "host_vars" / "rtx01.yml").write_text("# two entries\nmodels:\n  - family: diffusiongemma\n"
                                                 "  - family: diffusiongemma\n    gpus: 1\n")
    proc = _check(inv)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in said, said
    assert "host_vars/rtx01.yml:4: rtx01: models[1].family: diffusiongemma is declared twice for this host" in said
