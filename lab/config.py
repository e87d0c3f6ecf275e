"""Where the lab keeps things, its network, and its hosts."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
STATE = Path(os.environ.get("DGEMMA_LAB_STATE", "/var/lib/dgemma-lab"))
CACHE = Path(os.environ.get("DGEMMA_LAB_CACHE", "/var/cache/dgemma-lab"))
MIRROR = os.environ.get("DGEMMA_LAB_MIRROR", "http://deb.debian.org/debian")
SUITE = "bookworm"

BRIDGE = "dglab0"
SUBNET = "10.213.0"  # private, on this machine only: the bridge and the hosts' namespaces
GATEWAY = f"{SUBNET}.1"
PREFIX = 24
REGISTRY_PORT = 5000
HUB_PORT = 8088
REGISTRY = f"{GATEWAY}:{REGISTRY_PORT}"
HUB_URL = f"http://{GATEWAY}:{HUB_PORT}"

DEB_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}
# what every host's rootfs carries; python3-yaml for the hf CLI in the images
PACKAGES = ["systemd", "systemd-sysv", "dbus", "openssh-server", "iproute2", "python3", "python3-yaml",
            "curl", "ca-certificates", "podman", "crun", "conmon", "fuse-overlayfs", "util-linux", "procps",
            "netavark", "aardvark-dns", "containernetworking-plugins", "golang-github-containers-common"]
IMAGE_TAGS = {
    "x86_64": ["gemma-x86_64-cu130", "gemma-cu129", "v0.33.0-x86_64", "v0.33.0-x86_64-cu129"],
    "aarch64": ["gemma-aarch64-cu130", "gemma-aarch64-cu129", "v0.33.0-aarch64", "v0.33.0-aarch64-cu129"],
}
REPOSITORY = "vllm/vllm-openai"


@dataclass(frozen=True)
class LabHost:
    name: str
    arch: str
    profile: str  # lab/profiles/<profile>.json
    index: int

    @property
    def address(self) -> str:
        return f"{SUBNET}.{10 + self.index}"

    @property
    def netns(self) -> str:
        return f"dglab-{self.name}"

    @property
    def veth(self) -> str:
        return f"dgl{self.index}"  # machine side; interface names are at most 15 characters

    @property
    def root(self) -> Path:
        return STATE / "hosts" / self.name / "root"

    @property
    def dir(self) -> Path:
        return STATE / "hosts" / self.name


DEFAULT_HOSTS = [
    LabHost("spark01", "aarch64", "gb10", 1),
    LabHost("rtx01", "x86_64", "rtx5090", 2),
    LabHost("h100-01", "x86_64", "h100", 3),
]


def hosts(extra: int = 0) -> list[LabHost]:
    """The three profile hosts, plus ``extra`` plain x86_64 hosts for scale tests."""
    out = list(DEFAULT_HOSTS)
    for i in range(extra):
        out.append(LabHost(f"node{i + 1:02d}", "x86_64", "h100", 4 + i))
    return out
