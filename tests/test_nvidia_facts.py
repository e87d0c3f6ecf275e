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
        {"pid": 457, "name": "python3", "used_memory_mib": 31238}]


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
