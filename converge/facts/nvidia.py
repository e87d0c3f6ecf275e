"""NVIDIA GPU facts from ``nvidia-smi``, bounded by a timeout.

The supported CUDA version is not a ``--query-gpu`` field (``cuda_version`` is
refused); it is read from ``nvidia-smi --version`` or, on drivers without that,
from the header of plain ``nvidia-smi``. Drivers of branch 610 and later label
it ``CUDA UMD Version`` (and the driver ``KMD Version``); both spellings are read. Memory reads ``[N/A]`` or
``[Not Supported]`` on unified-memory GPUs (GB10, GH200): then it is None here
and callers use the host's MemAvailable, as vLLM does.
"""
from __future__ import annotations

import re

from . import LIBRARIES, Fact, FactError, call

GPU_FIELDS = ["index", "name", "uuid", "memory.total", "memory.used", "memory.free",
              "driver_version", "compute_cap", "pci.bus_id", "mig.mode.current"]
QUERY = f"--query-gpu={','.join(GPU_FIELDS)} --format=csv,noheader,nounits"
# gpu_uuid: which GPU each process is on (a process with a CUDA context holds memory on every
# GPU it touched, and pid, name and memory alone cannot tell its rows apart)
APPS_QUERY = "--query-compute-apps=pid,process_name,used_memory,gpu_uuid --format=csv,noheader,nounits"
UNAVAILABLE = {"[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]", ""}


def _number(text: str):
    text = text.strip()
    if text in UNAVAILABLE:
        return None
    text = re.sub(r"\s*MiB$", "", text)
    try:
        return int(text)
    except ValueError:
        try:
            return float(text)
        except ValueError:
            return None


def parse_gpu_query(text: str) -> list[dict]:
    """Rows of ``--query-gpu`` (the fields of GPU_FIELDS, csv, noheader, nounits)."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        # the last field (MIG mode) may be missing: a capture taken before it was asked
        if len(cells) not in (len(GPU_FIELDS), len(GPU_FIELDS) - 1):
            raise FactError(f"nvidia-smi printed an unexpected line: {line.strip()!r}")
        row = dict(zip(GPU_FIELDS, cells + [""]))
        cc = row["compute_cap"]
        gpus.append({
            "index": int(row["index"]),
            "name": row["name"],
            "uuid": row["uuid"],
            "memory_total_mib": _number(row["memory.total"]),
            "memory_used_mib": _number(row["memory.used"]),
            "memory_free_mib": _number(row["memory.free"]),
            "driver_version": row["driver_version"],
            "compute_capability": None if cc in UNAVAILABLE else cc,
            "pci_bus_id": row["pci.bus_id"],
            "mig_mode": None if row["mig.mode.current"] in UNAVAILABLE else row["mig.mode.current"],
        })
    return gpus


# driver 580: "DRIVER version : X" / "Driver Version: X"; 610 and later: "KMD version : X" / "KMD Version: X"
_DRIVER = re.compile(r"(?:DRIVER|KMD) version\s*:\s*([0-9][0-9.]*)", re.I)
# driver 580: "CUDA Version : 13.0"; 610 and later: "CUDA UMD Version: 13.3" (--version: "CUDA UMD version")
_CUDA = re.compile(r"CUDA (?:UMD )?Version\s*:\s*([0-9]+(?:\.[0-9]+)?)", re.I)


def parse_version(text: str) -> dict:
    """``nvidia-smi --version``, the plain table's header or ``-q``, in either
    generation's labels (``CUDA Version`` / ``CUDA UMD Version``)."""
    out = {}
    driver = _DRIVER.search(text)
    cuda = _CUDA.search(text)
    if driver:
        out["driver_version"] = driver.group(1)
    if cuda:
        out["cuda_version"] = cuda.group(1)
    return out


def parse_compute_apps(text: str) -> list[dict]:
    """Rows of ``--query-compute-apps`` (pid, name, memory, then the GPU's uuid when asked)."""
    apps = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.split(",")]
        if len(cells) >= 3 and cells[0].isdigit():
            apps.append({"pid": int(cells[0]), "name": cells[1], "used_memory_mib": _number(cells[2]),
                         "gpu_uuid": cells[3] if len(cells) > 3 and cells[3].startswith("GPU-") else None})
    return apps


def cuda_tuple(version: str | None) -> tuple[int, int] | None:
    if not version:
        return None
    major, _, minor = version.partition(".")
    return int(major), int(minor or 0)


# what files/nvidia.sh prints, a marker a line, and what follows each (parse_nvidia_smi_sections)
MARKERS = {"query": "RC: the GPUs' query (CSV) follows", "version": "RC: `nvidia-smi --version` follows",
           "apps": "RC: the compute apps' query follows", "missing": "nvidia-smi is not installed"}


class NvidiaSmi(Fact):
    """Everything the roles need from nvidia-smi, each call bounded by ``timeout`` seconds."""

    def __init__(self, timeout: int = 15):
        self.timeout = int(timeout)
        self.library, self.command = LIBRARIES / "nvidia.sh", call("fact_nvidia_smi", self.timeout, QUERY, APPS_QUERY)

    def process(self, output, rc):
        return parse_nvidia_smi_sections(output, self.timeout)


def parse_nvidia_smi_sections(output: str, timeout: int = 15) -> dict:
    sections: dict[str, tuple[int, list[str]]] = {}
    current = None
    for line in output.splitlines():
        if line.startswith("@missing"):
            raise FactError("nvidia-smi is not installed: install the NVIDIA driver (R580 or newer for CUDA 13 "
                            "images) and check that `nvidia-smi` runs")
        match = re.match(r"^@(query|version|apps) (\d+)$", line)
        if match:
            current = match.group(1)
            sections[current] = (int(match.group(2)), [])
        elif current:
            sections[current][1].append(line)
    if "query" not in sections:
        raise FactError("nvidia-smi printed nothing we could read")
    rc, lines = sections["query"]
    text = "\n".join(lines)
    if rc in (124, 137):
        raise FactError(f"nvidia-smi did not answer within {timeout} s: the GPU or driver is wedged; "
                        f"reboot the host (a container restart will not help)")
    if rc != 0:
        raise FactError(f"nvidia-smi failed (exit {rc}): {text.strip()[:300]}")
    gpus = parse_gpu_query(text)
    if not gpus:
        raise FactError("nvidia-smi lists no GPU")
    version = parse_version("\n".join(sections.get("version", (0, []))[1]))
    apps = parse_compute_apps("\n".join(sections.get("apps", (0, []))[1])) if sections.get("apps", (1,))[0] == 0 else []
    return {
        "gpus": gpus,
        "driver_version": version.get("driver_version") or gpus[0]["driver_version"],
        "cuda_version": version.get("cuda_version"),
        "compute_apps": apps,
    }


class Dcgm(Fact):
    """Whether the host runs NVIDIA's DCGM host engine (DGX OS and data-centre installs
    start ``nvidia-dcgm.service``): ``{"hostengine": bool, "dcgmi": path or None}``."""

    library, command = LIBRARIES / "nvidia.sh", "fact_dcgm"

    def process(self, output, rc):
        seen = dict(line.partition(" ")[::2] for line in output.splitlines() if " " in line)
        return {"hostengine": seen.get("service", "").strip() == "active" or seen.get("process", "").strip() == "yes",
                "dcgmi": None if seen.get("dcgmi", "-").strip() in ("-", "") else seen["dcgmi"].strip()}
