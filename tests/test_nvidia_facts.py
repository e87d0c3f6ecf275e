"""nvidia-smi parsing on real H100 captures and built GB10 / RTX 5090 outputs."""
import pytest

from converge.facts import FactError
from converge.facts.nvidia import (cuda_tuple, parse_compute_apps, parse_gpu_query, parse_nvidia_smi_sections,
                                   parse_version)
from tests.conftest import FIXTURES

H100 = FIXTURES / "nvidia-smi" / "h100"
BUILT = FIXTURES / "nvidia-smi" / "built"


def test_h100_idle_query_real_capture():
    (gpu,) = parse_gpu_query((H100 / "idle-query.csv").read_text())
    assert gpu["name"] == "NVIDIA H100 80GB HBM3"
    assert gpu["compute_capability"] == "9.0"
    assert (gpu["memory_total_mib"], gpu["memory_used_mib"], gpu["memory_free_mib"]) == (81559, 0, 81079)
    assert gpu["driver_version"] == "580.159.04"


def test_h100_busy_query_and_apps_real_capture():
    (gpu,) = parse_gpu_query((H100 / "busy-query.csv").read_text())
    assert gpu["memory_free_mib"] == 49833
    assert parse_compute_apps((H100 / "busy-compute-apps.csv").read_text()) == [
        {"pid": 457, "name": "python3", "used_memory_mib": 31238, "gpu_uuid": None}]  # not asked in that capture


def test_cuda_version_from_version_and_from_table_header():
    assert parse_version((H100 / "idle-version.txt").read_text()) == {"driver_version": "580.159.04",
                                                                     "cuda_version": "13.0"}
    assert parse_version((H100 / "idle-nvidia-smi.txt").read_text())["cuda_version"] == "13.0"
    assert parse_version((H100 / "idle-q.txt").read_text())["cuda_version"] == "13.0"
    assert cuda_tuple("12.9") < cuda_tuple("13.0")


def test_gb10_memory_is_not_available():
    for name in ("gb10-query.csv", "gb10-older-driver-query.csv"):
        (gpu,) = parse_gpu_query((BUILT / name).read_text())
        assert gpu["memory_total_mib"] is None and gpu["memory_free_mib"] is None
        assert gpu["compute_capability"] == "12.1"


def test_invalid_field_is_an_error_not_a_gpu():
    with pytest.raises(FactError, match="unexpected line"):
        parse_gpu_query((H100 / "invalid-field-cuda_version.txt").read_text())


def _sections(query, version="", rc=0):
    return f"@query {rc}\n{query}\n@version 0\n{version}\n@apps 0\n"


def test_sections_hang_missing_and_failure():
    with pytest.raises(FactError, match="wedged"):
        parse_nvidia_smi_sections("@query 124\n", 15)
    with pytest.raises(FactError, match="not installed"):
        parse_nvidia_smi_sections("@missing\n")
    with pytest.raises(FactError, match="failed"):
        parse_nvidia_smi_sections("@query 9\nNVIDIA-SMI has failed because it couldn't communicate\n")
    facts = parse_nvidia_smi_sections(_sections((H100 / "idle-query.csv").read_text(),
                                                (H100 / "idle-version.txt").read_text()))
    assert facts["cuda_version"] == "13.0" and facts["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3"


R610 = ["r610-version.txt", "r610-rtx5090-nvidia-smi.txt", "r610-q-head.txt"]


@pytest.mark.parametrize("name", R610)
def test_driver_610_labels_kmd_and_cuda_umd_versions(name):
    """Branch 610 relabels the versions (built from published headers, see built/README.md)."""
    assert parse_version((BUILT / name).read_text()) == {"driver_version": "610.43.02", "cuda_version": "13.3"}


def test_a_610_driver_picks_the_cu130_image():
    from roles.preflight.select import choose
    from converge.facts.host import parse_meminfo
    nvidia = parse_nvidia_smi_sections(_sections((BUILT / "r610-rtx5090-query.csv").read_text(),
                                                 (BUILT / "r610-version.txt").read_text()))
    assert nvidia["cuda_version"] == "13.3" and nvidia["driver_version"] == "610.43.02"
    choice = choose({"arch": "x86_64", "nvidia": nvidia,
                     "meminfo": parse_meminfo("MemTotal: 65536000 kB\nMemAvailable: 60000000 kB\n")},
                    {"gpu_memory_utilization": 0.7})
    assert choice.image == "vllm/vllm-openai:gemma-x86_64-cu130"
    assert "driver CUDA 13.3 >= 13.0" in choice.image_reason
    # and the fallback to the table header, when --version fails, reads the new header too
    nvidia = parse_nvidia_smi_sections("@query 0\n" + (BUILT / "r610-rtx5090-query.csv").read_text() +
                                       "@version 0\n" + (BUILT / "r610-rtx5090-nvidia-smi.txt").read_text() +
                                       "@apps 0\n")
    assert nvidia["cuda_version"] == "13.3"


def test_invoke_facts_local_on_a_610_driver_picks_cu130(tmp_path):
    """`invoke facts --local` end to end, with the lab's nvidia-smi stand-in printing
    the 610 format (the RTX 5090 profile) as this machine's nvidia-smi."""
    import json
    import subprocess
    import sys
    from tests.conftest import ROOT, standin_on_path
    env = standin_on_path(tmp_path, "rtx5090")
    proc = subprocess.run([sys.executable, "-m", "invoke", "facts", "--local", "--json", "-"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    host = json.loads(proc.stdout)["hosts"]["localhost"]
    assert host["facts"]["cuda_version"] == "13.3" and host["facts"]["driver_version"] == "610.43.02", proc.stderr
    assert host["choice"]["image"].endswith("vllm/vllm-openai:gemma-x86_64-cu130")


def test_the_fact_script_on_a_real_h100_reads_mig_mode_and_each_apps_gpu():
    """Captured on the lent H100 with the queries the fact asks now (CAPTURES-2026-11-23.md)."""
    facts = parse_nvidia_smi_sections((H100 / "facts-script-output.txt").read_text())
    (gpu,) = facts["gpus"]
    assert gpu["mig_mode"] == "Disabled" and gpu["memory_free_mib"] == 81079
    assert facts["cuda_version"] == "13.0" and facts["compute_apps"] == []
    (busy,) = parse_gpu_query((H100 / "busy20g-query-mig.csv").read_text())
    (app,) = parse_compute_apps((H100 / "busy20g-compute-apps-uuid.csv").read_text())
    assert app == {"pid": 459, "name": "python3", "used_memory_mib": 20998, "gpu_uuid": busy["uuid"]}
    assert busy["memory_used_mib"] == 21007 and busy["mig_mode"] == "Disabled"


def _nvidia_smi_stand_in(tmp_path, answer: str):
    """An nvidia-smi on a PATH of its own: ``answer`` is the shell it runs once it knows which of
    the fact's calls it is ($kind: query, version, apps, plain)."""
    import os
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text(f"""#!/bin/sh
case "$*" in
  --query-gpu=*) kind=query;;
  --version) kind=version;;
  --query-compute-apps=*) kind=apps;;
  *) kind=plain;;
esac
{answer}
""")
    (bin_dir / "nvidia-smi").chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}


def test_the_fact_asks_nvidia_smi_its_three_questions_at_once(tmp_path):
    """fact_nvidia_smi run for real: each call of the stand-in waits (up to 10 s, a bound against
    a hang, not a speed goal) for the other two to have begun, and says whether they met; the
    answers are real H100 captures, read as from a host."""
    import subprocess
    from converge.facts.nvidia import NvidiaSmi
    meet = tmp_path / "meet"
    meet.mkdir()
    answers = {"query": "busy-query.csv", "version": "idle-version.txt", "apps": "busy-compute-apps.csv"}
    env = _nvidia_smi_stand_in(tmp_path, f"""touch {meet}/$kind
all() {{ [ -e {meet}/query ] && [ -e {meet}/version ] && [ -e {meet}/apps ]; }}
for i in $(seq 100); do all && break; sleep 0.1; done
all && touch {meet}/$kind.met
case $kind in query) cat {H100}/{answers['query']};; version) cat {H100}/{answers['version']};;
  apps) cat {H100}/{answers['apps']};; esac""")
    fact = NvidiaSmi(30)
    out = subprocess.run(["sh", "-s"], input=fact.standalone(), capture_output=True, text=True, env=env, timeout=60)
    assert sorted(p.name for p in meet.iterdir() if p.suffix == ".met") == ["apps.met", "query.met", "version.met"]
    facts = fact.process(out.stdout, out.returncode)
    assert facts["gpus"][0]["name"] == "NVIDIA H100 80GB HBM3" and facts["cuda_version"]
    assert facts["compute_apps"], out.stdout


def test_a_wedged_nvidia_smi_costs_one_timeout_and_says_wedged(tmp_path):
    """Every call hangs: the three time out together and the fact says the GPU is wedged (the
    version's fallback, plain nvidia-smi, is not asked after a timeout: it would hang as long again)."""
    import subprocess
    from converge.facts.nvidia import NvidiaSmi
    calls = tmp_path / "calls"
    env = _nvidia_smi_stand_in(tmp_path, f"echo $kind >> {calls}; exec sleep 30")
    fact = NvidiaSmi(1)
    out = subprocess.run(["sh", "-s"], input=fact.standalone(), capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.splitlines()[0] == "@query 124" and "@version" not in out.stdout, out.stdout
    assert sorted(calls.read_text().split()) == ["apps", "query", "version"]
    with pytest.raises(FactError, match="did not answer within 1 s: the GPU or driver is wedged"):
        fact.process(out.stdout, out.returncode)
