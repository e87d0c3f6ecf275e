"""Where the lab keeps things, its network, and its hosts."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("DGEMMA_LAB_STATE", "/var/lib/dgemma-lab"))
CACHE = Path(os.environ.get("DGEMMA_LAB_CACHE", "/var/cache/dgemma-lab"))
# the lab inventory's api_key_file and credentials_dir (lab/inventory.py), and the fleet CA a
# deploy makes there: what a user of the lab holds
API_KEY_FILE = STATE / "secrets" / "api-key"
CREDENTIALS = STATE / "credentials"
CA_FILE = CREDENTIALS / "ca" / "ca.crt"
# seconds the vLLM stand-in takes from its start to its first answer (a real vLLM: ~140 s, seed
# 000). Every start in the lab waits it: the suite starts replicas ~110 times, most of them on
# its critical path (rolls one at a time), so it is short (spark01's stand-in takes ~5 s more to
# start under qemu anyway); a test that needs a slow start sets the per-host knob
# (lab/stubs/vllm: COLD_START_KNOB)
COLD_START_S = 1.0
MIRROR = os.environ.get("DGEMMA_LAB_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"

BRIDGE = "dglab0"
SUBNET = "10.213.0"  # private, on this machine only: the bridge and the hosts' namespaces
GATEWAY = f"{SUBNET}.1"
PREFIX = 24
# A second network, as a server room behind a bastion: this machine has no address on
# it and no route to it; its hosts reach the lab's services through a NAT router
# (a namespace of its own, not a host), and people reach them through bastion01.
PRIVATE_BRIDGE = "dglab1"
PRIVATE_SUBNET = "10.213.1"
PRIVATE_GATEWAY = f"{PRIVATE_SUBNET}.1"  # the NAT router's address there
NAT_NETNS = "dglab-nat"
NAT_OUTSIDE = f"{SUBNET}.2"  # the NAT router's address on the lab network
SUBNETS = {"lab": SUBNET, "private": PRIVATE_SUBNET}
# the fleet's one address (the inventory's gateway_address): held by one gateway at a time
GATEWAY_ADDRESS = f"{SUBNET}.200"
REGISTRY_PORT = 5000
HUB_PORT = 8088
REGISTRY = f"{GATEWAY}:{REGISTRY_PORT}"
HUB_URL = f"http://{GATEWAY}:{HUB_PORT}"
# the services themselves listen on this machine's loopback; the lab reaches them through
# the uplink (lab/uplink.py) on the addresses above; the lab's own work (pushing images)
# goes to them directly
REGISTRY_LOCAL = f"127.0.0.1:{REGISTRY_PORT + 1}"
HUB_LOCAL_PORT = HUB_PORT + 1

DEB_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
# what every host's rootfs carries; python3-yaml for the hf CLI in the images; the real
# Docker engine (docker.io) beside podman; sudo for logins that are not root
PACKAGES = ["systemd", "systemd-sysv", "dbus", "openssh-server", "iproute2", "python3", "python3-yaml",
            "curl", "ca-certificates", "podman", "crun", "conmon", "fuse-overlayfs", "util-linux", "procps",
            "netavark", "aardvark-dns", "containernetworking-plugins", "golang-github-containers-common",
            "sudo", "docker.io", "iptables",
            # podman's Recommends on Debian (apt installs it with podman): a pod's pause process
            # (podman kube play builds its infra image from it)
            "catatonit",
            # Debian 12's HAProxy, for its user: the front door image (library/haproxy) takes the base's
            # passwd and runs as haproxy; its binary is Debian 13's 3.0 (lab/haproxy_package.py)
            "haproxy",
            # Debian's keepalived: the gateways' shared address (VRRP), as on a real gateway host
            "keepalived",
            # Debian's node exporter, for the lab's image of prom/node-exporter (both arches)
            "prometheus-node-exporter"]
IMAGE_TAGS = {
    "x86_64": ["gemma-x86_64-cu130", "gemma-cu129", "v0.33.0-x86_64", "v0.33.0-x86_64-cu129"],
    "aarch64": ["gemma-aarch64-cu130", "gemma-aarch64-cu129", "v0.33.0-aarch64", "v0.33.0-aarch64-cu129"],
}
REPOSITORY = "vllm/vllm-openai"
# the front door's image: one tag, both arches (a manifest list, as Docker Hub's)
FRONTDOOR_REPOSITORY = "library/haproxy"
FRONTDOOR_TAG = "3.0"
# the monitoring stack's images (serving/catalog/images.yml names the same), built from Debian's
# packages: (repository, tag, the package, its program, the official image's, the arches)
MONITORING_IMAGES = {
    "node_exporter": ("prom/node-exporter", "v1.5.0", "prometheus-node-exporter", "/usr/bin/prometheus-node-exporter",
                      "/bin/node_exporter", ("x86_64", "aarch64")),
    # both arches, as the official images: a DGX Spark may be the monitoring host (the two-machine lab)
    "prometheus": ("prom/prometheus", "v2.42.0", "prometheus", "/usr/bin/prometheus", "/bin/prometheus",
                   ("x86_64", "aarch64")),
    "alertmanager": ("prom/alertmanager", "v0.25.0", "prometheus-alertmanager", "/usr/bin/prometheus-alertmanager",
                     "/bin/alertmanager", ("x86_64", "aarch64")),
}


@dataclass(frozen=True)
class LabHost:
    name: str
    arch: str
    profile: str | None  # lab/profiles/<profile>.json; None: no GPU (the bastion)
    index: int
    networks: tuple = ("lab",)  # the first is where its address is; a bastion has both
    login: str = "root"  # the user people log in as (root's SSH login is off otherwise)
    docker: bool = True  # whether the Docker engine runs (installed everywhere)
    gateway: bool = False  # the fleet's gateway (inventory group `gateway`): no GPU, not the bastion
    monitoring: bool = False  # runs Prometheus and Alertmanager (inventory group `monitoring`)

    @property
    def address(self) -> str:
        return self.address_on(self.networks[0])

    def address_on(self, network: str) -> str:
        return f"{SUBNETS[network]}.{10 + self.index}"

    @property
    def netns(self) -> str:
        return f"dglab-{self.name}"

    @property
    def veth(self) -> str:
        return self.veth_on(self.networks[0])

    def veth_on(self, network: str) -> str:
        # machine side; interface names are at most 15 characters
        return f"dgl{self.index}" if network == "lab" else f"dglp{self.index}"

    @property
    def bastion(self) -> bool:
        return self.profile is None and not self.gateway and not self.monitoring

    @property
    def has_gpu(self) -> bool:
        return self.profile is not None

    @property
    def root(self) -> Path:
        return STATE / "hosts" / self.name / "root"

    @property
    def dir(self) -> Path:
        return STATE / "hosts" / self.name


DEFAULT_HOSTS = [
    # DGX OS: the user made at first boot, whose sudo asks its password (seed 004's docker)
    LabHost("spark01", "aarch64", "gb10", 1, login="nvidia"),
    LabHost("rtx01", "x86_64", "rtx5090", 2),
    # a server behind a bastion, on a network this machine cannot reach
    LabHost("h100-01", "x86_64", "h100", 3, networks=("private",)),
    # a lab server with four GPUs: one vLLM replica per GPU (index 99: the scale nodes take 4 and up)
    LabHost("hgx01", "x86_64", "h200x4", 99),
    LabHost("bastion01", "x86_64", None, 0, networks=("lab", "private"), login="jump", docker=False),
    # the fleet's one address: HAProxy in front of every host's front door, on both networks
    # as a lab's gateway machine is (it reaches the servers behind the bastion directly)
    LabHost("gateway01", "x86_64", None, 100, networks=("lab", "private"), docker=False, gateway=True),
    # its twin: the two hold one address between them (VRRP), so no gateway is a single door
    LabHost("gateway02", "x86_64", None, 101, networks=("lab", "private"), docker=False, gateway=True),
    # the fleet's Prometheus and Alertmanager (group `monitoring`): a host of its own, not a gateway,
    # so that what watches the gateways does not go down with one; on both networks, as it
    # scrapes the hosts behind the bastion too
    LabHost("monitor01", "x86_64", None, 102, networks=("lab", "private"), docker=False, monitoring=True),
]
GPU_HOSTS = [h for h in DEFAULT_HOSTS if h.has_gpu]


def hosts(extra: int = 0) -> list[LabHost]:
    """The profile hosts and the bastion, plus ``extra`` plain x86_64 hosts for scale
    tests (no Docker engine running: 64 of them would not fit in memory)."""
    out = list(DEFAULT_HOSTS)
    for i in range(extra):
        out.append(LabHost(f"node{i + 1:02d}", "x86_64", "h100", 4 + i, docker=False))
    return out


def host(name: str) -> LabHost:
    for candidate in hosts(64):
        if candidate.name == name:
            return candidate
    raise KeyError(name)
