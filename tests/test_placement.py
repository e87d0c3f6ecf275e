"""Replicas on a host's GPUs (roles/preflight/placement.py), on the real captures of
a host with two H200s (tests/fixtures/nvidia-smi/h200x2/) and on built ones (built/)."""
import pytest

from converge.facts.nvidia import parse_compute_apps, parse_gpu_query
from roles.preflight.memory import GpuMemory, gpu_memory, passes_vllm_check
from roles.preflight.deployed import deployed_gpus, deployed_replicas, module_containers
from roles.preflight.placement import keep_indices, place
from roles.preflight.select import Refused
from tests.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "nvidia-smi"
H200 = FIXTURES / "h200x2"
BUILT = FIXTURES / "built"


def nvidia(query, apps=None):
    return {"gpus": parse_gpu_query(query.read_text()), "cuda_version": "13.0",
            "compute_apps": parse_compute_apps(apps.read_text()) if apps else []}


def test_h200x2_idle_gives_one_bf16_replica_per_gpu():
    placed = place(nvidia(H200 / "idle-query.csv"), {}, {})
    assert [(r.index, [g["index"] for g in r.gpus], r.tensor_parallel_size, r.quantization, r.port)
            for r in placed.replicas] == [(0, [0], 1, "bf16", 8100), (1, [1], 1, "bf16", 8101)]
    assert placed.skipped == []
    doc = placed.as_dict()
    assert doc["replicas"][1]["gpus"] == ["GPU-4d5f8a85-15cf-7668-0fc3-bb5cece760ec"]
    assert doc["replicas"][0]["model"] == "google/diffusiongemma-26B-A4B-it"


def test_h200x2_with_40_gib_held_on_gpu1_each_replica_passes_vllms_check_on_its_own_gpu():
    facts = nvidia(H200 / "busy1-query.csv", H200 / "busy1-compute-apps-uuid.csv")
    gpu0, gpu1 = facts["gpus"]
    assert gpu0["memory_free_mib"] == 142630  # the process's CUDA context: 518 MiB on GPU 0 too
    placed = place(facts, {}, {})
    assert len(placed.replicas) == 2
    for replica in placed.replicas:
        (gpu,) = replica.gpus
        mem = gpu_memory(gpu, {})
        assert passes_vllm_check(mem, replica.utilization)
        # with the 1024 MiB margin: the next hundredth would leave less than the margin
        assert not passes_vllm_check(GpuMemory(mem.total_mib, mem.free_mib - 1024, False, mem.cuda_total_mib),
                                     round(replica.utilization + 0.01, 2)) or replica.utilization == 0.95
    # (101578 free - 720 for vLLM's worker - 1024 margin) / 143157 CUDA total (used + free), floored
    assert placed.replicas[1].utilization == 0.69


def test_a_gpu_whose_free_memory_fails_vllms_check_is_left_out_with_vllms_words():
    facts = nvidia(H200 / "busy1-query.csv", H200 / "busy1-compute-apps-uuid.csv")
    placed = place(facts, {}, {"gpu_memory_utilization": 0.9})
    assert [r.gpus[0]["index"] for r in placed.replicas] == [0]
    (skipped,) = placed.skipped
    assert skipped["uuid"] == "GPU-4d5f8a85-15cf-7668-0fc3-bb5cece760ec"
    assert "on GPU 1: Free memory on device cuda:0 (98.49/139.80 GiB) on startup is less than desired GPU memory " \
           "utilization (0.9, 125.82 GiB)" in skipped["reason"]
    assert "python3 (pid 616, 41570 MiB)" in skipped["reason"]  # the row of GPU 1, not GPU 0's 518
    with pytest.raises(Refused, match=r"GPU 1 .*Free memory on device cuda:0"):
        place(facts, {}, {"gpu_memory_utilization": 0.9, "gpus": [1]})  # named: refused, not skipped
    assert len(place(facts, {}, {"gpu_memory_utilization": 0.9, "gpus": [0]}).replicas) == 1


def test_built_8_h100_with_two_gpus_mostly_taken_gives_six_replicas_and_two_skipped():
    placed = place(nvidia(BUILT / "h100x8-two-busy-query.csv", BUILT / "h100x8-two-busy-compute-apps.csv"), {}, {})
    assert [r.gpus[0]["index"] for r in placed.replicas] == [0, 1, 2, 4, 5, 7]
    assert [r.port for r in placed.replicas] == list(range(8100, 8106))
    assert all(r.tensor_parallel_size == 1 and r.quantization == "bf16" for r in placed.replicas)
    assert [s["index"] for s in placed.skipped] == [3, 6]
    assert all("no DiffusionGemma variant fits" in s["reason"] for s in placed.skipped)


def test_built_two_24_gb_ada_cards_give_one_fp8_replica_with_tensor_parallel_2():
    placed = place(nvidia(BUILT / "rtx4090x2-query.csv"), {}, {})
    (replica,) = placed.replicas
    assert replica.tensor_parallel_size == 2 and replica.quantization == "fp8"
    assert [g["index"] for g in replica.gpus] == [0, 1] and placed.skipped == []
    assert "no variant fits one GPU" in replica.reason


def test_mig_gpus_are_left_out_with_the_reason_and_refused_when_named():
    facts = nvidia(BUILT / "h100-mig-query.csv")
    assert facts["gpus"][0]["mig_mode"] == "Enabled" and facts["gpus"][1]["mig_mode"] == "Disabled"
    placed = place(facts, {}, {})
    assert [r.gpus[0]["index"] for r in placed.replicas] == [1]
    assert "MIG mode is on" in placed.skipped[0]["reason"] and "nvidia-smi -i 0 -mig 0" in placed.skipped[0]["reason"]
    with pytest.raises(Refused, match="MIG mode is on"):
        place(facts, {}, {"gpus": ["GPU-89e7186f-d78b-cbf2-c3eb-9b84c4828937"]})


def test_gpus_as_a_count_or_an_unknown_name():
    placed = place(nvidia(H200 / "idle-query.csv"), {}, {"gpus": 1})
    assert len(placed.replicas) == 1 and placed.skipped[0]["reason"].startswith("gpus: 1")
    with pytest.raises(Refused, match="gpus: 3, but this host has 2"):
        place(nvidia(H200 / "idle-query.csv"), {}, {"gpus": 3})
    with pytest.raises(Refused, match="gpus: 7 is not a GPU of this host"):
        place(nvidia(H200 / "idle-query.csv"), {}, {"gpus": [7]})


def test_mixed_gpus_are_placed_gpu_by_gpu():
    h100 = parse_gpu_query((FIXTURES / "h100" / "idle-query.csv").read_text())
    ada = parse_gpu_query((BUILT / "rtx4090x2-query.csv").read_text())[:1]
    ada[0]["index"] = 1
    placed = place({"gpus": h100 + ada, "compute_apps": []}, {}, {})
    assert [(r.gpus[0]["index"], r.quantization) for r in placed.replicas] == [(0, "bf16")]
    assert [s["index"] for s in placed.skipped] == [1]  # one 24 GB card alone fits no variant


def test_a_gpu_that_runs_our_replica_keeps_the_utilization_it_started_with():
    facts = nvidia(H200 / "busy1-query.csv", H200 / "busy1-compute-apps-uuid.csv")
    placed = place(facts, {}, {"gpu_memory_utilization": 0.9},
                   running={"GPU-4d5f8a85-15cf-7668-0fc3-bb5cece760ec": 0.9})
    assert [r.utilization for r in placed.replicas] == [0.9, 0.9] and placed.skipped == []


def test_h200_captures_read_with_their_mig_mode_and_gpu_uuids():
    rows = (H200 / "mode.csv").read_text().splitlines()[1:]
    assert [r.split(", ")[2] for r in rows] == ["Disabled", "Disabled"]
    apps = parse_compute_apps((H200 / "busy1-compute-apps-uuid.csv").read_text())
    assert [(a["used_memory_mib"], a["gpu_uuid"][-4:]) for a in apps] == [(518, "157c"), (41570, "60ec")]
    assert parse_compute_apps((H200 / "busy1-compute-apps.csv").read_text())[0]["gpu_uuid"] is None


def test_the_running_services_gpus_are_read_from_what_declares_it():
    gpus = nvidia(H200 / "idle-query.csv")["gpus"]
    gpu0, gpu1 = (g["uuid"] for g in gpus)
    unit = "ExecStart=/usr/bin/podman run --device nvidia.com/gpu={} img m --gpu-memory-utilization 0.7"
    assert deployed_gpus(unit.format("all"), gpus) == {gpu0: 0.7}  # the previous release: vLLM ran on cuda:0
    assert deployed_gpus(unit.format(gpu1), gpus) == {gpu1: 0.7}
    assert deployed_gpus(unit.format("1"), gpus) == {gpu1: 0.7}
    docker = "ExecStart=/usr/bin/docker run --gpus '\"device={},{}\"' img m --gpu-memory-utilization 0.5"
    assert deployed_gpus(docker.format(gpu1, gpu0), gpus) == {gpu1: 0.5, gpu0: 0.5}
    module = 'extraOptions = [ "--gpus=all" ]; cmd = [ "m" "--gpu-memory-utilization" "0.6" ];'
    assert deployed_gpus(module, gpus) == {gpu0: 0.6}
    assert deployed_gpus("no utilization here", gpus) == {}


def test_a_replica_keeps_its_index_on_the_gpus_it_held():
    """GPU 0 busy: its replica (0) is gone, the other keeps index 1 and its port; freed
    again, GPU 0's replica takes index 0 back. New replicas take the lowest free index."""
    idle = nvidia(H200 / "idle-query.csv")
    gpu0, gpu1 = (g["uuid"] for g in idle["gpus"])
    placed = keep_indices(place(idle, {}, {}), {gpu0: 0, gpu1: 1}, {})
    assert [(r.index, r.port, r.gpus[0]["uuid"]) for r in placed.replicas] == [(0, 8100, gpu0), (1, 8101, gpu1)]
    only_gpu1 = keep_indices(place(idle, {}, {"gpus": [1]}), {gpu0: 0, gpu1: 1}, {})
    assert [(r.index, r.port) for r in only_gpu1.replicas] == [(1, 8101)]
    swapped = keep_indices(place(idle, {}, {}), {gpu1: 0}, {})
    assert [(r.index, r.gpus[0]["uuid"]) for r in swapped.replicas] == [(0, gpu1), (1, gpu0)]


def test_each_replica_of_a_nixos_module_is_read_on_its_own():
    gpus = [{"index": 0, "uuid": "GPU-a"}, {"index": 1, "uuid": "GPU-b"}]
    module = ('virtualisation.oci-containers.containers."vllm-diffusiongemma" = {\n cmd = [ "m" '
              '"--gpu-memory-utilization" "0.6" ]; extraOptions = [ "--device=nvidia.com/gpu=GPU-a" ];\n};\n'
              'virtualisation.oci-containers.containers."vllm-diffusiongemma-1" = {\n cmd = [ "m" '
              '"--gpu-memory-utilization" "0.8" ]; extraOptions = [ "--device=nvidia.com/gpu=GPU-b" ];\n};\n'
              'virtualisation.oci-containers.containers."dgemma-frontdoor" = {\n cmd = [ "haproxy" ];\n};\n')
    parts = module_containers(module)
    assert list(parts) == ["vllm-diffusiongemma", "vllm-diffusiongemma-1", "dgemma-frontdoor"]
    held = deployed_replicas({0: parts["vllm-diffusiongemma"], 1: parts["vllm-diffusiongemma-1"]}, gpus)
    assert held == {0: {"GPU-a": 0.6}, 1: {"GPU-b": 0.8}}


