"""Serve flags composed from variables, systemd quoting, and both unit flavours."""
import json
import shlex

import pytest

import roles
from converge.errors import StepFailed
from converge.play import Play
from serving.replicas import Served, from_unit, installed, replica
from roles.service.role import render_env, render_unit

NVFP4 = "nvidia/diffusiongemma-26B-A4B-it-NVFP4"
from serving.container_unit import systemd_quote
from serving.vllm_serve import check_flags, known_options, serve_args
from tests.conftest import ROOT


def hostvars(name, **extra):
    return Play.load(str(ROOT / "inventory"), roles.schemas(), roles.defaults(),
                     [f"{k}={v}" for k, v in extra.items()]).hostvars(name)


def unquote_systemd(line: str) -> list[str]:
    # systemd's quoting is close enough to POSIX single quotes with backslash escapes for these values
    return shlex.split(line.replace("\\'", "'\"'\"'").replace("%%", "%").replace("$$", "$"))


def served(v, index, model, utilization, gpus=(), size=1, family="diffusiongemma"):
    return Served(replica(v, index, family, gpus), model, utilization, size)


def test_serve_args_match_the_seed_command_and_parse():
    args = serve_args(hostvars("spark01"), "nvidia/diffusiongemma-26B-A4B-it-NVFP4", 0.7, 1, 8100)
    assert args[0] == "nvidia/diffusiongemma-26B-A4B-it-NVFP4"
    joined = " ".join(args)
    for expected in ("--max-model-len 100000", "--gpu-memory-utilization 0.7", "--max-num-batched-tokens 8192",
                     "--max-num-seqs 4", "--attention-backend TRITON_ATTN", "--tool-call-parser gemma4",
                     "--reasoning-parser gemma4", "--enable-auto-tool-choice", "--enable-chunked-prefill"):
        assert expected in joined
    dc = json.loads(args[args.index("--diffusion-config") + 1])
    assert dc == {"canvas_length": 256, "max_denoising_steps": 48}
    assert json.loads(args[args.index("--override-generation-config") + 1]) == {"max_new_tokens": None}
    assert "--enforce-eager" not in args and "--api-key" not in args
    assert all(a in known_options() for a in args if a.startswith("--"))


def test_unknown_or_harmful_extra_flags_are_refused():
    with pytest.raises(StepFailed, match="no option --made-up"):
        serve_args(hostvars("rtx01"), "m/x", 0.7, 1, 8100) and check_flags(["--made-up"])
    with pytest.raises(StepFailed, match="enforce-eager"):
        serve_args({**hostvars("rtx01"), "extra_serve_args": ["--enforce-eager"]}, "m/x", 0.7, 1, 8100)


def test_systemd_quoting_round_trips():
    for arg in ['{"canvas_length": 256}', "50%", "$HOME", "it's", "plain"]:
        assert unquote_systemd(systemd_quote(arg)) == [arg]


def test_podman_unit_is_on_demand_with_conflicts_and_bounded_restarts():
    v = hostvars("rtx01")
    unit = render_unit(v, "vllm/vllm-openai:gemma-x86_64-cu130", served(v, 0, NVFP4, 0.7), False)
    assert "Conflicts=ollama.service" in unit
    assert "StartLimitBurst=3" in unit and "StartLimitIntervalSec=900" in unit and "Restart=on-failure" in unit
    assert "ExecStartPre=-/usr/bin/podman rm -f vllm-diffusiongemma" in unit
    assert "ExecStop=/usr/bin/podman stop -t 30 vllm-diffusiongemma" in unit
    assert "EnvironmentFile=/etc/dgemma/vllm-diffusiongemma.env" in unit
    exec_start = next(line for line in unit.splitlines() if line.startswith("ExecStart="))
    argv = unquote_systemd(exec_start[len("ExecStart="):])
    assert argv[:5] == ["/usr/bin/podman", "run", "--rm", "--name", "vllm-diffusiongemma"]
    # the container's lines go straight to the unit's journal stream, once (not through conmon too)
    assert argv[5:7] == ["--log-driver", "passthrough"]
    assert "nvidia.com/gpu=all" in argv and "HF_HUB_OFFLINE=1" in argv and "VLLM_API_KEY" in argv
    assert not any(a.startswith("VLLM_API_KEY=") for a in argv)


def test_docker_unit_uses_gpus_all_and_the_docker_service():
    v = hostvars("spark01")
    unit = render_unit(v, "vllm/vllm-openai:gemma-aarch64-cu130", served(v, 0, NVFP4, 0.7), True)
    assert "Requires=docker.service" in unit and "--gpus all" in unit and "/usr/bin/docker run --rm" in unit
    assert "--log-driver" not in unit  # docker has no passthrough: its attached client relays the lines
    assert "-e HF_TOKEN " in unit and "Conflicts=" not in unit


def test_env_file_holds_the_secrets():
    assert render_env("k3y", "hf_x") .splitlines()[1:] == ["VLLM_API_KEY=k3y", "HF_TOKEN=hf_x"]


def test_the_unit_hands_over_only_the_placements_gpus_by_uuid():
    gpus = ["GPU-c4e45dc5-923e-4dd7-b871-0c1b63d1157c", "GPU-4d5f8a85-15cf-7668-0fc3-bb5cece760ec"]
    model = "RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic"

    def argv(v, gpus, size=1, index=0):
        unit = render_unit(v, "vllm/vllm-openai:gemma-x86_64-cu130", served(v, index, model, 0.7, tuple(gpus), size), False)
        return unquote_systemd(next(line for line in unit.splitlines() if line.startswith("ExecStart="))[10:])
    podman = argv(hostvars("rtx01"), gpus[1:])
    assert [podman[i + 1] for i, a in enumerate(podman) if a == "--device"] == [f"nvidia.com/gpu={gpus[1]}"]
    assert "--tensor-parallel-size" not in podman
    docker = argv(hostvars("spark01"), gpus, 2)
    # docker reads --gpus as CSV: the quotes keep both uuids in one device= field
    assert docker[docker.index("--gpus") + 1] == f'"device={gpus[0]},{gpus[1]}"'
    assert docker[docker.index("--tensor-parallel-size") + 1] == "2"
    assert argv(hostvars("spark01"), gpus[:1])[argv(hostvars("spark01"), gpus[:1]).index("--gpus") + 1] == \
        f"device={gpus[0]}"


def test_replica_n_has_its_own_name_port_and_environment_note():
    v = hostvars("rtx01")
    unit = render_unit(v, "vllm/vllm-openai:gemma-x86_64-cu130", served(v, 2, NVFP4, 0.8, ("GPU-x",)), False)
    argv = unquote_systemd(next(line for line in unit.splitlines() if line.startswith("ExecStart="))[10:])
    assert argv[argv.index("--name") + 1] == "vllm-diffusiongemma-2"
    assert argv[argv.index("--port") + 1] == "8102" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert "ExecStop=/usr/bin/podman stop -t 30 vllm-diffusiongemma-2" in unit
    assert "/run/dgemma/vllm-diffusiongemma-2.env-started" in unit
    # every replica reads the one environment file
    assert "EnvironmentFile=/etc/dgemma/vllm-diffusiongemma.env" in unit


def test_replica_units_are_told_from_other_units():
    v = {"container_runtime": "docker", "service_name": "dg"}
    assert replica(v, 0).unit == "docker-dg.service" and replica(v, 3).unit == "docker-dg-3.service"
    # another family's replicas say it, after the service's name
    assert replica(v, 2, "gemma4").unit == "docker-dg-gemma4-2.service"
    assert replica({}, 2, "gemma4").container == "vllm-gemma4-2"
    assert [(r.index, r.family) if r else None for r in (from_unit(v, u) for u in (
        "docker-dg.service", "/etc/systemd/system/docker-dg-12.service", "docker-dg-gemma4-3.service",
        "docker-dg-0.service", "docker-dg-x.service", "podman-dg-1.service", "docker-dg-frontdoor.service"))] == \
        [(0, "diffusiongemma"), (12, "diffusiongemma"), (3, "gemma4"), None, None, None, None]
    units = {"/etc/systemd/system/docker-dg.service": {"state": {"LoadState": "loaded", "ActiveState": "active"}},
             "/etc/systemd/system/docker-dg-2.service": {"state": {"LoadState": "loaded", "ActiveState": "failed"}},
             "/etc/systemd/system/docker-dg-3.service": {"state": {"LoadState": "not-found"}}}
    found = installed(v, units)
    assert {i: (r.unit, state["ActiveState"]) for i, (r, state) in found.items()} == \
        {0: ("docker-dg.service", "active"), 2: ("docker-dg-2.service", "failed")}
    # a move to a family's name cut short: two units of one index, the one that runs counts
    units["/etc/systemd/system/docker-dg-gemma4-2.service"] = {"state": {"LoadState": "loaded",
                                                                       "ActiveState": "active"}}
    assert installed(v, units)[2][0].unit == "docker-dg-gemma4-2.service"
    assert installed(v, {}) == {}


def test_generation_defaults_per_family_go_on_the_serve_line_over_the_catalogs():
    """The catalog's max_new_tokens null (no 256 cap) unless the inventory sets the family's own."""
    v = {**hostvars("rtx01"), "generation_defaults": {"diffusiongemma": {"top_p": 0.95, "max_new_tokens": 2048,
                                                                         "temperature": 0.7}}}
    dg = serve_args(v, NVFP4, 0.7, 1, 8100)
    assert dg[dg.index("--override-generation-config") + 1] == \
        '{"max_new_tokens": 2048, "temperature": 0.7, "top_p": 0.95}'  # one order, whatever the inventory's
    g4 = serve_args(v, "google/gemma-4-26B-A4B-it", 0.9, 1, 8101, family="gemma4")
    assert json.loads(g4[g4.index("--override-generation-config") + 1]) == {"max_new_tokens": None}
    from serving.vllm_serve import generation_in_force
    assert generation_in_force(["vllm", "serve", "m", *dg[1:]]) == {"max_new_tokens": 2048, "temperature": 0.7,
                                                                    "top_p": 0.95}
    assert generation_in_force(["vllm", "serve", "m"]) is None


def test_generation_defaults_are_checked_naming_file_line_and_key(tmp_path):
    import shutil
    inv = tmp_path / "inventory"
    shutil.copytree(ROOT / "inventory", inv)
    (inv / "host_vars" / "rtx01.yml").write_text(
        "generation_defaults:\n  diffusiongemma:\n    temperature: 3\n    max_tokens: 10\n")
    found = "\n".join(Play.load(str(inv), roles.schemas(), roles.defaults(), []).problems())
    assert "host_vars/rtx01.yml:3: generation_defaults.diffusiongemma.temperature: 3 is greater than the maximum 2" in found
    assert "host_vars/rtx01.yml:2: generation_defaults.diffusiongemma: Additional properties are not allowed " \
           "('max_tokens' was unexpected)" in found
    from serving.declared import declared
    from roles.preflight.select import Refused
    with pytest.raises(Refused, match=r"generation_defaults.gemma5: 'gemma5' is not in the model catalog"):
        declared({"generation_defaults": {"gemma5": {"temperature": 0.5}}})
