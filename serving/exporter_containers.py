"""What runs on a host for its metrics, whatever declares it (our units, or the NixOS
module the service role writes): the node exporter's and NVIDIA's DCGM exporter's
containers, the collector's unit and what it reads. Pure."""
from __future__ import annotations

from serving import scrape_targets
from serving.catalog import monitoring_image
from serving.container_unit import Container
from serving.haproxy.instance import FRONTDOOR, runtime_socket

TEXTFILES = "/var/lib/dgemma/metrics"  # the node exporter's textfile collector reads these
COLLECTOR = "/etc/dgemma/metrics/collector.sh"
COLLECTOR_UNIT = "dgemma-metrics-collector.service"
COLLECTOR_UNIT_PATH = f"/etc/systemd/system/{COLLECTOR_UNIT}"
DCGM_COUNTERS = "/etc/dgemma/metrics/dcgm-counters.csv"
# the DCGM fields the rules and dashboards read: NVIDIA's default counters, the memory total,
# the power limit, the maximum SM clock and the clock event (throttle) reasons
DCGM_FIELDS = [("DCGM_FI_DEV_SM_CLOCK", "gauge", "SM clock frequency (in MHz)."),
               ("DCGM_FI_DEV_MAX_SM_CLOCK", "gauge", "Maximum SM clock frequency (in MHz)."),
               ("DCGM_FI_DEV_MEM_CLOCK", "gauge", "Memory clock frequency (in MHz)."),
               ("DCGM_FI_DEV_MEMORY_TEMP", "gauge", "Memory temperature (in C)."),
               ("DCGM_FI_DEV_GPU_TEMP", "gauge", "GPU temperature (in C)."),
               ("DCGM_FI_DEV_POWER_USAGE", "gauge", "Power draw (in W)."),
               ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "gauge", "Power management limit (in W)."),
               ("DCGM_FI_DEV_GPU_UTIL", "gauge", "GPU utilization (in %)."),
               ("DCGM_FI_DEV_MEM_COPY_UTIL", "gauge", "Memory utilization (in %)."),
               ("DCGM_FI_DEV_FB_FREE", "gauge", "Framebuffer memory free (in MiB)."),
               ("DCGM_FI_DEV_FB_USED", "gauge", "Framebuffer memory used (in MiB)."),
               ("DCGM_FI_DEV_FB_TOTAL", "gauge", "Framebuffer memory total (in MiB)."),
               ("DCGM_FI_DEV_CLOCKS_EVENT_REASONS", "gauge", "Current clock event (throttle) reasons, a bitmask."),
               ("DCGM_FI_DEV_XID_ERRORS", "gauge", "Value of the last XID error encountered.")]


def node_exporter(v: dict) -> Container:
    """The official node exporter in a container: the host's network, the host's / read-only
    under /host, and its /proc and /sys read there. Not --pid=host, as its documentation runs
    it: the host's /proc under /host gives the same figures, and a runtime that creates no
    cgroups for its containers (podman inside a container, as on the lab's hosts) refuses it."""
    port = int(v.get("node_exporter_port", scrape_targets.NODE_EXPORTER_PORT))
    return Container(
        "dgemma-node-exporter", "The host's metrics for the DiffusionGemma fleet's Prometheus",
        monitoring_image(v, "node_exporter"),
        args=("--path.rootfs=/host", "--path.procfs=/host/proc", "--path.sysfs=/host/sys",
              f"--web.listen-address=127.0.0.1:{port}", f"--collector.textfile.directory=/host{TEXTFILES}"),
        options=("--network=host",), volumes=("/:/host:ro,rslave",),
        ready_url=f"http://127.0.0.1:{port}/metrics")


def dcgm_exporter(v: dict, hostengine: bool = True) -> Container:
    """NVIDIA's DCGM exporter, handed every GPU, with the fields of DCGM_COUNTERS: reading
    the host's own DCGM host engine (nv-hostengine on localhost:5555) when it runs, its
    embedded one otherwise (``gpu_metrics: dcgm`` on a host without the service)."""
    port = int(v.get("dcgm_exporter_port", scrape_targets.DCGM_EXPORTER_PORT))
    runtime = v.get("container_runtime", "podman")
    gpus = ("--device", "nvidia.com/gpu=all") if runtime == "podman" else ("--gpus", "all")
    engine = ("-r", "localhost:5555") if hostengine else ()
    return Container(
        "dgemma-dcgm-exporter", "The GPUs' metrics (NVIDIA DCGM) for the DiffusionGemma fleet's Prometheus",
        monitoring_image(v, "dcgm_exporter"),
        args=("-a", f"127.0.0.1:{port}", *engine, "-f", "/etc/dcgm-exporter/dgemma-counters.csv"),
        options=("--network=host", "--cap-add", "SYS_ADMIN", *gpus),
        volumes=(f"{DCGM_COUNTERS}:/etc/dcgm-exporter/dgemma-counters.csv:ro",),
        ready_url=f"http://127.0.0.1:{port}/metrics")


def collector_environment(v: dict, dcgm: bool, replicas) -> dict[str, str]:
    """What the collector reads (every value schema-checked: no quote or blank in it);
    ``replicas``: the host's (serving.replicas.Replica), each ``index:unit:server``."""
    return {"DGEMMA_INTERVAL": str(int(v.get("gpu_metrics_interval_s", 10))), "DGEMMA_TEXTFILES": TEXTFILES,
            "DGEMMA_WEIGHTS": v.get("model_cache", "/srv/models/hf-cache"),
            "DGEMMA_NVIDIA_SMI_TIMEOUT": str(int(v.get("nvidia_smi_timeout", 15))),
            "DGEMMA_GPUS": "0" if dcgm else "1",
            "DGEMMA_REPLICAS": ",".join(f"{r.index}:{r.unit}:{r.server}" for r in replicas),
            "DGEMMA_FRONTDOOR_SOCKET": runtime_socket(FRONTDOOR)}


def collector_unit(v: dict, dcgm: bool, replicas) -> str:
    return ("# Managed by dgemma-fleet (roles/exporters): edits here are replaced on the next deploy.\n"
            "[Unit]\nDescription=What the node exporter cannot read itself (GPUs from nvidia-smi, the weights' disk, "
            "vLLM's units), as its textfiles\n\n"
            "[Service]\nType=simple\n"
            + "".join(f"Environment={k}={val}\n" for k, val in collector_environment(v, dcgm, replicas).items()) +
            f"ExecStart=/bin/sh {COLLECTOR}\nRestart=always\nRestartSec=5\n"
            "# a reading takes a fork of nvidia-smi: keep it from competing with vLLM's own threads\n"
            "Nice=10\n\n[Install]\nWantedBy=multi-user.target\n")


def dcgm_counters() -> str:
    return ("# Managed by dgemma-fleet (roles/exporters): the DCGM fields its rules and dashboards read.\n"
            + "".join(f"{name}, {kind}, {doc}\n" for name, kind, doc in DCGM_FIELDS))


def nixos_declarations(v: dict, dcgm: bool, replicas) -> dict:
    """What the NixOS module declares for the host's metrics (the exporters role writes the
    collector's script and the textfiles beside it): the exporters' containers and the
    collector's service, with the same names as our units."""
    containers = ([node_exporter(v)] if v.get("node_exporter_managed", True) else []) + \
        ([dcgm_exporter(v)] if dcgm else [])
    return {"containers": [{"name": c.name, "image": c.image, "cmd": list(c.args),
                            "volumes": list(c.volumes), "options": list(c.options)} for c in containers],
            "collector": {"unit": COLLECTOR_UNIT.removesuffix(".service"), "script": COLLECTOR,
                          "environment": collector_environment(v, dcgm, replicas)}}
