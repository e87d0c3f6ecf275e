"""The lab's inventory: the seeds' hosts and groups with the lab's addresses,
key, known_hosts, registry mirror and hub, so ``invoke deploy --hosts
spark01,rtx01`` works against it unchanged. Each host is reached as the
seeds' machines are: spark01 as its user with sudo asking a password (in a
0600 file), h100-01 through bastion01 (ProxyJump, the Ansible way), rtx01 as
root with a key."""
from __future__ import annotations

import os
import secrets

import yaml

from . import config, rootfs

GROUP_OF = {"gb10": "spark", "rtx5090": "rtx", "h100": "h100", "h200x4": "hgx"}
# the runtime of each group as in the shipped inventory (inventory/group_vars)
GROUP_VARS = {
    # the GPU stand-in is Python, under qemu-user here: a reading of it takes about a second of CPU
    # (a real GB10's nvidia-smi, 0.05 s), so the lab reads it every 60 s, not every 10, and gives it
    # 60 s a call, not 15, before calling it wedged: on a CI machine's 2 busy cores, beside the other
    # facts, one call once took more than 15 s (a deploy failed "nvidia-smi did not answer within 15 s")
    "spark": {"container_runtime": "docker", "gpu_memory_utilization": 0.7, "max_model_len": 100000,
              "autostart": True, "gpu_metrics_interval_s": 60, "nvidia_smi_timeout": 60},
    "rtx": {"container_runtime": "podman", "gpu_memory_utilization": 0.7, "autostart": False,
            "conflicts": ["ollama.service"]},
    "h100": {"container_runtime": "podman", "gpu_memory_utilization": "auto", "autostart": True},
    # a fixed fraction, as on shared servers: a GPU another job holds fails vLLM's check and is left out
    # seed 001's two tiers on one host: DiffusionGemma on two GPUs, Gemma 4 on the rest
    "hgx": {"container_runtime": "podman", "gpu_memory_utilization": 0.9, "autostart": True,
            "models": [{"family": "diffusiongemma", "gpus": 2}, {"family": "gemma4"}]},
    "scale": {"container_runtime": "podman", "gpu_memory_utilization": "auto", "autostart": False},
    # the gateways share one address on the lab network (VRRP between them)
    "gateway": {"container_runtime": "podman", "gateway_address": config.GATEWAY_ADDRESS},
    # Prometheus and Alertmanager
    "monitoring": {"container_runtime": "podman"},
}
BASTION = next(h for h in config.DEFAULT_HOSTS if h.bastion)


def host_vars(host: config.LabHost) -> dict:
    """How the inventory reaches one host."""
    out: dict = {"ansible_host": host.address}
    if host.login != "root":
        out.update(ansible_user=host.login, ansible_become=True,
                   become_password_file=str(rootfs.become_password_file(host)))
    if "lab" not in host.networks:
        out["ansible_ssh_common_args"] = f"-o ProxyJump={BASTION.login}@{BASTION.address}"
    return out


# The small lab (`inventory-small`, beside the built-in one): the same machines, the serving hosts
# alone, two of them gateways too and one of those the monitoring host, as a lab with no machine
# to spare runs. h100-01 stays out: it is behind the bastion, on a network the office hosts
# cannot reach, so no gateway there could send it requests (as in the seeds' lab). Its gateways
# hold an address and a VRRP id of their own, so that both inventories' gateways can run at once.
SMALL_GATEWAYS = ("rtx01", "hgx01")
SMALL_MONITORING = ("hgx01",)
SMALL_LEFT_OUT = ("h100-01",)
SMALL_GATEWAY_ADDRESS = f"{config.SUBNET}.201"
SMALL_VRRP_ID = 52


# The two-machine lab (`inventory-two`): the mission's `invoke deploy --hosts spark01,rtx01` with
# everything on. spark01 serves, is the one gateway (no shared address: clients use its own) and
# the monitoring host, as a DGX Spark beside a desktop would be (rtx01 is NixOS in the seeds, which
# can be neither); rtx01 serves. No model_fallback: Gemma 4 is not served there.
TWO_HOSTS = ("spark01", "rtx01")
TWO_GATEWAY = "spark01"


def directory():
    return config.STATE / "inventory"


def small_directory():
    return config.STATE / "inventory-small"


def two_directory():
    return config.STATE / "inventory-two"


def _group_of(host: config.LabHost) -> str:
    return ("gateway" if host.gateway else "monitoring" if host.monitoring
            else GROUP_OF.get(host.profile, "h100") if not host.name.startswith("node") else "scale")


def write(hosts: list[config.LabHost]) -> str:
    """The built-in inventory, and the small and two-machine ones beside it (`write_small`, `write_two`)."""
    children: dict = {}
    for host in hosts:
        if host.bastion:
            continue  # the way in, not a place to deploy to
        children.setdefault(_group_of(host), {"hosts": {}})["hosts"][host.name] = host_vars(host)
    path = _write(directory(), children, GROUP_VARS)
    write_small(hosts)
    write_two(hosts)
    return path


def write_small(hosts: list[config.LabHost]) -> str:
    """The small lab's inventory: rtx01 in `rtx` and `gateway`, hgx01 in `hgx`, `gateway` and
    `monitoring`, spark01 in `spark` (a host serves and gateways by being in both groups)."""
    serving = [h for h in hosts if h.has_gpu and not h.name.startswith("node") and h.name not in SMALL_LEFT_OUT]
    children: dict = {}
    for host in serving:
        children.setdefault(_group_of(host), {"hosts": {}})["hosts"][host.name] = host_vars(host)
    names = {h.name for h in serving}
    children["gateway"] = {"hosts": {name: None for name in SMALL_GATEWAYS if name in names}}
    children["monitoring"] = {"hosts": {name: None for name in SMALL_MONITORING if name in names}}
    group_vars = {**GROUP_VARS, "gateway": {"gateway_address": SMALL_GATEWAY_ADDRESS, "gateway_vrrp_id": SMALL_VRRP_ID},
                  "monitoring": {}}
    return _write(small_directory(), children, group_vars)


def write_two(hosts: list[config.LabHost]) -> str:
    """The two-machine lab's inventory: spark01 in `spark`, `gateway` and `monitoring`, rtx01 in
    `rtx`."""
    children: dict = {}
    for host in (h for h in hosts if h.name in TWO_HOSTS):
        children.setdefault(_group_of(host), {"hosts": {}})["hosts"][host.name] = host_vars(host)
    children["gateway"] = {"hosts": {TWO_GATEWAY: None}}
    children["monitoring"] = {"hosts": {TWO_GATEWAY: None}}
    # each host's own runtime (spark01's docker): the groups' runtimes are the dedicated hosts'
    group_vars = {**GROUP_VARS, "gateway": {}, "monitoring": {}}
    return _write(two_directory(), children, group_vars, fallback=False)


def _write(inv, children: dict, group_vars: dict, fallback: bool = True) -> str:
    (inv / "group_vars").mkdir(parents=True, exist_ok=True)
    key_file = config.API_KEY_FILE
    key_file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not key_file.exists():
        key_file.write_text(secrets.token_urlsafe(24) + "\n")
        os.chmod(key_file, 0o600)
    data = {"all": {"vars": {
        "ansible_user": "root",
        "ansible_ssh_private_key_file": str(config.STATE / "ssh" / "id_ed25519"),
        "known_hosts_file": str(config.STATE / "ssh" / "known_hosts"),
        "registry": config.REGISTRY,
        "hf_endpoint": config.HUB_URL,
        "api_key_file": str(key_file),
        # the fleet CA and the users' key hashes of the lab (not the user's own)
        "credentials_dir": str(config.CREDENTIALS),
        "ready_timeout": 300,
        # the lab rebuilds its images when the stand-ins change: hosts follow the registry
        "image_pull": "always",
        "model_cache": "/srv/models/hf-cache",
        # DiffusionGemma's requests go to Gemma 4 while no DiffusionGemma replica can take them
        **({"model_fallback": {"diffusiongemma": {"to": "gemma4"}}} if fallback else {}),
    }, "children": children}}
    header = "# Written by `invoke lab.up`: the lab's hosts. Regenerated on every lab.up.\n"
    (inv / "hosts.yml").write_text(header + yaml.safe_dump(data, sort_keys=False))
    for group in children:
        (inv / "group_vars" / f"{group}.yml").write_text(header + yaml.safe_dump(group_vars[group], sort_keys=False))
    for stale in (inv / "group_vars").glob("*.yml"):
        if stale.stem not in children:
            stale.unlink()
    return str(inv)


def write_known_hosts(hosts: list[config.LabHost]):
    """Each host's real keys, read from its rootfs: host-key checking stays on."""
    lines = []
    for host in hosts:
        for pub in sorted((host.root / "etc/ssh").glob("ssh_host_*_key.pub")):
            keytype, key = pub.read_text().split()[:2]
            names = ",".join(host.address_on(n) for n in host.networks)
            lines.append(f"{names} {keytype} {key}\n")
    path = config.STATE / "ssh" / "known_hosts"
    path.write_text("".join(lines))
