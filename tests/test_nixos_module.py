"""The NixOS module the service role writes on NixOS hosts, parsed and evaluated by
real Nix (Debian's nix-bin: nix-instantiate) against a small stub of `lib`."""
import json
import shutil
import subprocess

import pytest

from serving.nixos_module import imported, imports_line, module_name, nix_value
from serving.replicas import Served, replica
from roles.service.role import render_module, render_unit

NIX = shutil.which("nix-instantiate")
pytestmark = pytest.mark.skipif(NIX is None, reason="needs nix-instantiate (apt-get install nix-bin; run.sh does)")
IMAGE = "docker.io/vllm/vllm-openai:gemma-x86_64-cu130"
MODEL = "nvidia/diffusiongemma-26B-A4B-it-NVFP4"
# lib.mkForce and lib.mkBefore as nixpkgs defines them: an override of priority 50, an order of 500
LIB = ('{ mkForce = x: { _type = "override"; priority = 50; content = x; }; '
       'mkBefore = x: { _type = "order"; priority = 500; content = x; }; }')


def evaluate(text: str, tmp_path) -> dict:
    path = tmp_path / "module.nix"
    path.write_text(text)
    parsed = subprocess.run([NIX, "--parse", str(path)], capture_output=True, text=True)
    assert parsed.returncode == 0, parsed.stderr
    out = subprocess.run([NIX, "--eval", "--strict", "--json", "-E",
                          f"(import {path}) {{ config = {{}}; lib = {LIB}; pkgs = {{}}; }}"],
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


TWO_GPUS = ["GPU-c4e45dc5-923e-4dd7-b871-0c1b63d1157c", "GPU-4d5f8a85-15cf-7668-0fc3-bb5cece760ec"]


@pytest.mark.parametrize("hostvars,gpus", [
    ({"container_runtime": "podman", "conflicts": ["ollama.service"], "autostart": False}, None),  # seed 000's desktop
    ({"container_runtime": "docker", "autostart": True, "max_model_len": 100000, "service_name": "dg-2"}, None),
    ({"container_runtime": "podman", "autostart": True, "extra_serve_args": ["--enable-prefix-caching"],
      "start_limit_burst": 5, "conflicts": ["ollama.service", "comfyui@gpu0.service"]}, TWO_GPUS[1:]),
    ({"container_runtime": "podman", "autostart": True}, TWO_GPUS),
    ({"container_runtime": "docker", "autostart": True}, TWO_GPUS),
])
def test_every_rendered_module_evaluates_to_the_declared_service(tmp_path, hostvars, gpus):
    size = len(gpus or [0])
    served = Served(replica(hostvars, 0, gpus=gpus or ()), MODEL, 0.7, size)
    module = evaluate(render_module(hostvars, IMAGE, [served], True), tmp_path)
    name = hostvars.get("service_name", "vllm-diffusiongemma")
    runtime = hostvars["container_runtime"]
    container = module["virtualisation"]["oci-containers"]["containers"][name]
    assert module["virtualisation"]["oci-containers"]["backend"] == runtime
    assert container["image"] == IMAGE
    assert container["cmd"][0] == MODEL and "--gpu-memory-utilization" in container["cmd"]
    assert container["cmd"][container["cmd"].index("--gpu-memory-utilization") + 1] == "0.7"
    assert container["environmentFiles"] == [f"/etc/dgemma/{name}.env"]
    assert container["autoStart"] is hostvars["autostart"]
    # handed the placement's GPUs by uuid (all of them when none is named)
    if runtime == "podman":
        assert [o for o in container["extraOptions"] if "nvidia.com/gpu" in o] == \
            [f"--device=nvidia.com/gpu={g}" for g in gpus or ["all"]]
    else:
        assert [o for o in container["extraOptions"] if o.startswith("--gpus")] == \
            ["--gpus=all" if not gpus else f'--gpus="device={",".join(gpus)}"' if size > 1 else f"--gpus=device={gpus[0]}"]
    assert ("--tensor-parallel-size" in container["cmd"]) == (size > 1)
    if size > 1:
        assert container["cmd"][container["cmd"].index("--tensor-parallel-size") + 1] == str(size)
    unit = module["systemd"]["services"][f"{runtime}-{name}"]
    assert unit.get("conflicts", []) == hostvars.get("conflicts", [])
    if hostvars["autostart"]:
        assert "wantedBy" not in unit
    else:
        assert unit["wantedBy"] == {"_type": "override", "priority": 50, "content": []}
    assert unit["startLimitBurst"] == hostvars.get("start_limit_burst", 3)
    assert unit["serviceConfig"]["Restart"]["content"] == "on-failure"
    # before oci-containers' own preStart: the sha256 of the environment this start reads
    assert unit["preStart"]["_type"] == "order" and \
        f"sha256sum < /etc/dgemma/{name}.env > /run/dgemma/{name}.env-started" in unit["preStart"]["content"]
    # the same command line as the unit for hosts that are not NixOS
    exec_start = next(line for line in render_unit(hostvars, IMAGE, served, True).splitlines()
                      if line.startswith("ExecStart="))
    assert f" {IMAGE} {MODEL} " in exec_start
    assert exec_start.split(f" {IMAGE} ", 1)[1].count(" --") == sum(a.startswith("--") for a in container["cmd"])


def test_nix_strings_survive_anything_a_value_may_hold(tmp_path):
    values = ['say "hi"', "back\\slash", "${builtins.currentTime}", "dollar $ sign", "line\nbreak\ttab",
              "ünïcode ✓", "", "'single'", "''${x}''"]
    evaluated = evaluate(f"{{ ... }}: {{ v = {nix_value(values)}; }}", tmp_path)
    assert evaluated["v"] == values


def test_the_configuration_imports_the_module_or_not():
    v = {"service_name": "vllm-diffusiongemma"}
    name = module_name(v)
    assert imports_line(v) == f"imports = [ ./{name} ];"
    assert imported({"/etc/nixos/configuration.nix": f"{{\n  imports = [ ./hardware.nix ./{name} ];\n}}\n"}, v)
    assert imported({"/etc/nixos/configuration.nix": f"imports =\n  [\n    ./{name}\n  ];\n"}, v)
    assert not imported({"/etc/nixos/configuration.nix": f"# imports = [ ./{name} ];\n"}, v)
    assert not imported({"/etc/nixos/configuration.nix": "imports = [ ./dgemma-vllm-diffusiongemma.nix.bak ];"}, v)
    assert not imported({f"/etc/nixos/{name}": f"# {name}\n"}, v)  # the module naming itself does not count


def test_one_module_declares_every_replica(tmp_path):
    v = {"container_runtime": "podman", "autostart": True}
    replicas = [Served(replica(v, 0, gpus=("GPU-a",)), MODEL, 0.7), Served(replica(v, 2, gpus=("GPU-c",)), MODEL, 0.8)]
    module = evaluate(render_module(v, IMAGE, replicas, False), tmp_path)
    containers = module["virtualisation"]["oci-containers"]["containers"]
    assert sorted(containers) == ["dgemma-frontdoor", "dgemma-node-exporter", "vllm-diffusiongemma",
                                  "vllm-diffusiongemma-2"]
    # the host's metrics: the node exporter on loopback over the host's / read-only, and the collector
    exporter = containers["dgemma-node-exporter"]
    assert "--web.listen-address=127.0.0.1:9100" in exporter["cmd"] and exporter["volumes"] == ["/:/host:ro,rslave"]
    collector = module["systemd"]["services"]["dgemma-metrics-collector"]
    assert collector["serviceConfig"]["ExecStart"] == "/bin/sh /etc/dgemma/metrics/collector.sh"
    assert collector["environment"]["DGEMMA_REPLICAS"] == \
        "0:podman-vllm-diffusiongemma.service:replica0,2:podman-vllm-diffusiongemma-2.service:replica2"
    second = containers["vllm-diffusiongemma-2"]
    assert second["cmd"][second["cmd"].index("--port") + 1] == "8102"
    assert [o for o in second["extraOptions"] if "nvidia.com/gpu" in o] == ["--device=nvidia.com/gpu=GPU-c"]
    assert "vllm-diffusiongemma-2.env-started" in \
        module["systemd"]["services"]["podman-vllm-diffusiongemma-2"]["preStart"]["content"]
