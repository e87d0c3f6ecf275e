"""Image, model and memory choice on real and built GPU outputs."""
import pytest

from converge.facts.host import parse_meminfo
from converge.facts.nvidia import parse_compute_apps, parse_gpu_query, parse_version
from roles.preflight.memory import GpuMemory, largest_safe_utilization, passes_vllm_check
from roles.preflight.select import Refused, choose, choose_image
from tests.conftest import FIXTURES

H100 = FIXTURES / "nvidia-smi" / "h100"
BUILT = FIXTURES / "nvidia-smi" / "built"
HOST_MEM = parse_meminfo("MemTotal: 131072000 kB\nMemAvailable: 120000000 kB\n")


def facts(query, version, arch="x86_64", apps="", meminfo=HOST_MEM):
    v = parse_version(version.read_text())
    return {"arch": arch, "meminfo": meminfo,
            "nvidia": {"gpus": parse_gpu_query(query.read_text()), "cuda_version": v.get("cuda_version"),
                       "driver_version": v.get("driver_version"), "compute_apps": parse_compute_apps(apps)}}


RTX = facts(BUILT / "rtx5090-query.csv", BUILT / "rtx5090-version.txt")
H100_IDLE = facts(H100 / "idle-query.csv", H100 / "idle-version.txt")
H100_BUSY = facts(H100 / "busy-query.csv", H100 / "idle-version.txt", apps=(H100 / "busy-compute-apps.csv").read_text())
GB10 = facts(BUILT / "gb10-query.csv", BUILT / "gb10-version.txt", "aarch64",
             meminfo=parse_meminfo((BUILT / "gb10-meminfo.txt").read_text()))


def test_rtx5090_seed_trap_09_refused_with_vllms_reason_07_passes():
    with pytest.raises(Refused) as refused:
        choose(RTX, {"gpu_memory_utilization": 0.9})
    # vLLM's figures: CUDA's free once its worker holds its 720 MiB, CUDA's total
    assert "Free memory on device cuda:0 (27.14/31.84 GiB) on startup is less than desired GPU memory " \
           "utilization (0.9, 28.66 GiB)" in str(refused.value)
    choice = choose(RTX, {"gpu_memory_utilization": 0.7})
    assert choice.model == "nvidia/diffusiongemma-26B-A4B-it-NVFP4"
    assert choice.image == "vllm/vllm-openai:gemma-x86_64-cu130"


def test_h100_real_capture_busy_refuses_09_and_names_the_holder():
    with pytest.raises(Refused) as refused:
        choose(H100_BUSY, {"gpu_memory_utilization": 0.9})
    assert "python3 (pid 457, 31238 MiB)" in str(refused.value)
    assert "largest safe value now is 0.59" in str(refused.value)


def test_h100_auto_takes_bf16_idle_and_fp8_when_busy():
    idle = choose(H100_IDLE, {})
    assert (idle.model, idle.utilization) == ("google/diffusiongemma-26B-A4B-it", 0.95)
    busy = choose(H100_BUSY, {})
    assert busy.model == "RedHatAI/diffusiongemma-26B-A4B-it-FP8-dynamic"
    assert passes_vllm_check(busy.memory, busy.utilization)
    assert "NVFP4" not in idle.model + busy.model


def test_gb10_uses_memavailable_and_the_aarch64_tag():
    choice = choose(GB10, {"gpu_memory_utilization": 0.7, "registry": "10.0.0.1:5000"})
    assert choice.memory.unified and choice.memory.free_mib == 120586240 / 1024
    assert choice.image == "10.0.0.1:5000/vllm/vllm-openai:gemma-aarch64-cu130"
    assert choice.model == "nvidia/diffusiongemma-26B-A4B-it-NVFP4"


def test_cuda_129_gets_cu129_and_older_is_refused_with_remedy():
    ada = facts(BUILT / "rtx4090-cuda129-query.csv", BUILT / "cuda129-version.txt")
    assert choose_image("x86_64", "12.9", {})[0] == "vllm/vllm-openai:gemma-cu129"
    with pytest.raises(Refused, match="FP8-dynamic needs a GPU of 30518 MiB, this one has 24564"):
        choose(ada, {})  # 24 GB Ada: NVFP4 needs Blackwell, FP8 needs 32 GB
    arm = facts(BUILT / "gb10-query.csv", BUILT / "cuda129-version.txt", "aarch64", meminfo=GB10["meminfo"])
    assert choose(arm, {}).image == "vllm/vllm-openai:gemma-aarch64-cu129"
    old = facts(BUILT / "rtx5090-query.csv", BUILT / "cuda124-version.txt")
    with pytest.raises(Refused, match="R580"):
        choose(old, {})


def test_not_enough_memory_says_how_much_is_needed():
    with pytest.raises(Refused, match=r"needs 21668 MiB"):
        choose(RTX, {"gpu_memory_utilization": 0.3})


def test_overrides_and_largest_safe():
    choice = choose(RTX, {"image": "mirror:5000/x/y:z", "model": "org/custom", "gpu_memory_utilization": 0.5})
    assert (choice.image, choice.model) == ("mirror:5000/x/y:z", "org/custom")
    mem = GpuMemory(32607, 28511, False)
    util = largest_safe_utilization(mem, 1024)
    assert passes_vllm_check(mem, util) and not passes_vllm_check(GpuMemory(32607, 28511 - 1024, False), util + 0.01)


def test_the_prediction_matches_what_vllms_worker_saw_on_a_real_h100():
    """bench/vllm_memory on the lent H100: nvidia-smi's free memory, then, in a process doing
    what vLLM's worker does before its snapshot, torch's free and total (vllm-snapshot.json)."""
    import json
    from roles.preflight.memory import gpu_memory
    measured = json.loads((H100 / "vllm-snapshot.json").read_text())
    (gpu,) = parse_gpu_query((H100 / "idle-query-mig.csv").read_text())
    for case in measured["cases"]:
        held = gpu["memory_free_mib"] - case["nvidia_smi_free_mib"]
        mem = gpu_memory({**gpu, "memory_used_mib": gpu["memory_used_mib"] + held,
                          "memory_free_mib": case["nvidia_smi_free_mib"]}, {})
        assert mem.vllm_total_mib == case["torch_total_mib"]  # CUDA's total: 81079, not nvidia-smi's 81559
        assert abs(mem.vllm_free_mib - case["vllm_snapshot_free_mib"]) < 8, case
        # the largest value vLLM accepted is the largest we let through
        assert largest_safe_utilization(mem, 0) == min(case["largest_util_vllm_accepts"], 0.95)
