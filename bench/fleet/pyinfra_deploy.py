"""The fleet benchmark's work for pyinfra: the same as ours.py and playbook.yml."""
from io import StringIO

from pyinfra import host
from pyinfra.api import FactBase
from pyinfra.operations import files, systemd


class GpuQuery(FactBase):
    def command(self):
        return ("nvidia-smi --query-gpu=index,name,uuid,memory.total,memory.used,memory.free,driver_version,"
                "compute_cap,pci.bus_id --format=csv,noheader,nounits")

    def process(self, output):
        return [line.split(", ") for line in output]


class ImageExists(FactBase):
    def command(self):
        return "podman image exists 10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130 && echo yes || echo no"

    def process(self, output):
        return output[0] == "yes"


host.get_fact(GpuQuery)
for path in ("/etc/fleetbench", "/srv/fleetbench/cache"):
    files.directory(name=f"directory {path}", path=path, mode="755")
files.put(name="environment file", src=StringIO("VLLM_API_KEY=benchkey\n"), dest="/etc/fleetbench/bench.env",
          mode="600")
unit = files.template(name="unit file", src="templates/unit.j2", dest="/etc/systemd/system/fleetbench.service",
                      inventory_hostname=host.name, bench_port=host.data.get("bench_port", 8000))
host.get_fact(ImageExists)
systemd.service(name="not enabled", service="fleetbench.service", enabled=False, daemon_reload=unit.changed)
