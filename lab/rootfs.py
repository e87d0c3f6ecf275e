"""Root filesystems: one Debian 12 base per arch (debootstrap, cached), copied
per host and given that host's identity: name, machine id, SSH host keys, the
lab's authorized key, its GPU profile."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from . import config, sh

BASE_VERSION = "4"  # bump when what goes into a base rootfs changes

HOST_PACKAGES = ["debootstrap", "systemd-container", "qemu-user-static", "binfmt-support", "podman", "crun",
                 "conmon", "uidmap", "fuse-overlayfs", "docker-registry", "skopeo", "openssh-client",
                 "iproute2", "util-linux", "curl", "python3-pip"]

CONTAINERS_CONF = """\
# Written by the dgemma lab. Inside systemd-nspawn: no cgroup v1 paths for
# containers, and ulimits at or below the machine's hard limits.
[containers]
cgroups = "disabled"
default_ulimits = ["nofile=16384:16384", "nproc=32768:32768"]
keyring = false
{extra_containers}
[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
runtime = "crun"
{extra_engine}
"""

ARM64_CONTAINERS = 'seccomp_profile = "unconfined"'
ARM64_ENGINE = 'conmon_path = ["/opt/x86/bin/conmon"]\n[engine.runtimes]\ncrun = ["/opt/x86/bin/crun"]'

REGISTRIES_CONF = f"""\
unqualified-search-registries = ["docker.io"]

[[registry]]
location = "{config.REGISTRY}"
insecure = true
"""

POLICY_JSON = '{"default": [{"type": "insecureAcceptAnything"}]}\n'

STORAGE_CONF = """\
[storage]
driver = "overlay"
runroot = "/run/containers/storage"
graphroot = "/var/lib/containers/storage"
"""

MEMINFO_UNIT = """\
[Unit]
Description=GPU stand-in: the unified memory a GB10 host reports in /proc/meminfo
ConditionPathExists=/etc/nvidia-stub/meminfo
DefaultDependencies=no
Before=sysinit.target

[Service]
Type=oneshot
RemainAfterExit=yes
ExecStart=/bin/mount --bind /etc/nvidia-stub/meminfo /proc/meminfo

[Install]
WantedBy=sysinit.target
"""


def ensure_machine_packages(log=print):
    missing = [p for p in HOST_PACKAGES if not sh.ok("dpkg-query", "-W", "-f=${Status}", p)
               or "install ok installed" not in sh.run("dpkg-query", "-W", "-f=${Status}", p, check=False).stdout]
    if missing:
        log(f"installing {' '.join(missing)}")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        sh.run("apt-get", "update", "-q", env=env, timeout=900)
        sh.run("apt-get", "install", "-y", "-q", "--no-install-recommends", *missing, env=env, timeout=1800)


def ensure_binfmt():
    if not Path("/proc/sys/fs/binfmt_misc/status").exists():
        sh.run("mount", "-t", "binfmt_misc", "binfmt_misc", "/proc/sys/fs/binfmt_misc")
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not entry.exists() or "enabled" not in entry.read_text():
        sh.run("update-binfmts", "--enable", "qemu-aarch64")
    if "F" not in entry.read_text().split("flags:")[1].split("\n")[0]:
        raise sh.LabError("binfmt_misc's qemu-aarch64 entry lacks the F flag; reinstall qemu-user-static")


def base_dir(arch: str) -> Path:
    return config.CACHE / f"rootfs-{config.DEB_ARCH[arch]}"


def _stamp(path: Path) -> Path:
    return path / f".dgemma-base-{BASE_VERSION}"


def ensure_base(arch: str, log=print) -> Path:
    """A finished base rootfs for ``arch``; a half-built one is thrown away."""
    final = base_dir(arch)
    if _stamp(final).exists():
        return final
    work = final.with_name(final.name + ".building")
    shutil.rmtree(work, ignore_errors=True)
    config.CACHE.mkdir(parents=True, exist_ok=True)
    log(f"debootstrap {config.SUITE} {config.DEB_ARCH[arch]} into {work} (once; cached)")
    sh.run("debootstrap", f"--arch={config.DEB_ARCH[arch]}", "--variant=minbase",
           f"--include={','.join(config.PACKAGES)}", config.SUITE, work, config.MIRROR, timeout=1800)
    _customise_base(work, arch)
    shutil.rmtree(final, ignore_errors=True)
    work.rename(final)
    _stamp(final).touch()
    return final


def _remove(path: Path):
    if path.exists() or path.is_symlink():
        try:
            shutil.rmtree(path)
        except OSError as exc:
            raise sh.LabError(f"cannot remove {path}: {exc}. Run `invoke lab.down`, then `invoke lab.up`") from exc


def _write(root: Path, rel: str, text: str, mode: int = 0o644):
    path = root / rel.lstrip("/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(mode)


def _customise_base(root: Path, arch: str):
    for f in (root / "etc/ssh").glob("ssh_host_*"):
        f.unlink()  # each host gets its own keys
    for pending in (root / "etc/containers").glob("*.dpkg-new"):
        pending.unlink()
    _write(root, "/etc/containers/containers.conf", CONTAINERS_CONF.format(
        extra_containers=ARM64_CONTAINERS if arch == "aarch64" else "",
        extra_engine=ARM64_ENGINE if arch == "aarch64" else ""))
    _write(root, "/etc/containers/registries.conf", REGISTRIES_CONF)
    _write(root, "/etc/containers/policy.json", POLICY_JSON)
    _write(root, "/etc/containers/storage.conf", STORAGE_CONF)
    _write(root, "/etc/ssh/sshd_config.d/dgemma-lab.conf",
           "PasswordAuthentication no\nPermitRootLogin prohibit-password\nUseDNS no\nMaxStartups 100:30:200\n"
           "MaxSessions 64\n")
    _write(root, "/etc/systemd/system/nvidia-stub-meminfo.service", MEMINFO_UNIT)
    wants = root / "etc/systemd/system/sysinit.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / "nvidia-stub-meminfo.service"
    if not link.is_symlink():
        link.symlink_to("/etc/systemd/system/nvidia-stub-meminfo.service")
    # units that cannot work in a container and only make the state "degraded"
    for unit in ("systemd-networkd-wait-online.service", "apt-daily.timer", "apt-daily-upgrade.timer",
                 "e2scrub_all.timer", "fstrim.timer"):
        mask = root / "etc/systemd/system" / unit
        if not mask.exists():
            mask.symlink_to("/dev/null")
    if arch == "aarch64":
        _native_runtime(root)
    shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)


def _native_runtime(root: Path):
    """An arm64 crun cannot run under qemu-user; give the arm64 podman the
    machine's native crun and conmon with their libraries (LAB-NOTES.md)."""
    target = root / "opt/x86/bin"
    target.mkdir(parents=True, exist_ok=True)
    for tool in ("crun", "conmon"):
        src = shutil.which(tool) or f"/usr/bin/{tool}"
        shutil.copy2(src, target / tool)
        for line in sh.run("ldd", src).stdout.splitlines():
            parts = line.split("=>")
            lib = (parts[1] if len(parts) > 1 else parts[0]).strip().split(" (")[0].strip()
            if lib.startswith("/"):
                dest = root / lib.lstrip("/")
                dest.parent.mkdir(parents=True, exist_ok=True)
                if not dest.exists():
                    shutil.copy2(os.path.realpath(lib), dest)


def lab_key() -> Path:
    key = config.STATE / "ssh" / "id_ed25519"
    if not key.exists():
        key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        sh.run("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "dgemma-lab", "-f", key)
    return key


def prepare_host(host: config.LabHost, fresh: bool = False, log=print):
    """The host's own rootfs: a copy of the base with the host's identity."""
    base = ensure_base(host.arch, log)
    marker = host.dir / f".from-base-{BASE_VERSION}"
    if fresh or not marker.exists() or not (host.root / "etc/os-release").exists():
        from .machines import release_disk
        release_disk(host)  # nothing of an earlier instance may still hold or mount it
        marker.unlink(missing_ok=True)
        work = host.dir / "root.new"
        _remove(work)
        host.dir.mkdir(parents=True, exist_ok=True)
        sh.run("cp", "-a", "--reflink=auto", base, work)
        (work / f".dgemma-base-{BASE_VERSION}").unlink(missing_ok=True)
        _remove(host.root)
        work.rename(host.root)
        marker.touch()
    root = host.root
    _write(root, "/etc/hostname", host.name + "\n")
    _write(root, "/etc/hosts", f"127.0.0.1 localhost\n{host.address} {host.name}\n"
           f"{config.GATEWAY} lab-gateway\n")
    machine_id = root / "etc/machine-id"
    if len(machine_id.read_text().strip()) != 32:
        machine_id.write_text(os.urandom(16).hex() + "\n")
    for keytype in ("ed25519", "rsa"):
        key = root / f"etc/ssh/ssh_host_{keytype}_key"
        if not key.exists():
            sh.run("ssh-keygen", "-q", "-t", keytype, "-N", "", "-C", f"root@{host.name}", "-f", key)
    pub = lab_key().with_suffix(".pub").read_text()
    _write(root, "/root/.ssh/authorized_keys", pub, 0o600)
    (root / "root/.ssh").chmod(0o700)
    _install_gpu_standin(root, host)


def _install_gpu_standin(root: Path, host: config.LabHost):
    profile = json.loads((config.HERE / "profiles" / f"{host.profile}.json").read_text())
    _write(root, "/usr/bin/nvidia-smi", (config.HERE / "stubs" / "nvidia-smi").read_text(), 0o755)
    _write(root, "/etc/nvidia-stub/profile.json", json.dumps(profile, indent=2) + "\n")
    state = root / "etc/nvidia-stub/state.json"
    if not state.exists():
        _write(root, "/etc/nvidia-stub/state.json", "{}\n")
    meminfo = root / "etc/nvidia-stub/meminfo"
    mounts = [
        {"hostPath": "/usr/bin/nvidia-smi", "containerPath": "/usr/bin/nvidia-smi", "options": ["ro", "nosuid", "bind"]},
        {"hostPath": "/etc/nvidia-stub", "containerPath": "/etc/nvidia-stub", "options": ["ro", "nosuid", "bind"]},
        {"hostPath": "/var/lib/nvidia-stub", "containerPath": "/var/lib/nvidia-stub", "options": ["rw", "nosuid", "bind"]},
    ]
    if profile.get("unified_memory"):
        write_meminfo(root, profile, held_mib=0)
        mounts.append({"hostPath": "/etc/nvidia-stub/meminfo", "containerPath": "/proc/meminfo",
                       "options": ["ro", "bind"]})
    else:
        meminfo.unlink(missing_ok=True)
    # a real CDI spec, as nvidia-ctk writes one; what it mounts is the stand-in
    cdi = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu",
           "devices": [{"name": "all", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}},
                       {"name": "0", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}],
           "containerEdits": {"env": ["NVIDIA_STUB=1"], "mounts": mounts}}
    _write(root, "/etc/cdi/nvidia.yaml", json.dumps(cdi, indent=2) + "\n")
    (root / "var/lib/nvidia-stub/apps").mkdir(parents=True, exist_ok=True)


def write_meminfo(root: Path, profile: dict, held_mib: int = 0):
    """GB10: the host's /proc/meminfo says what a 128 GB Spark says."""
    total = profile["host_mem_total_mib"] * 1024
    avail = max(profile["host_mem_available_mib"] - held_mib, 0) * 1024
    text = (f"MemTotal:       {total} kB\nMemFree:        {avail} kB\nMemAvailable:   {avail} kB\n"
            f"Buffers:               0 kB\nCached:                0 kB\nSwapTotal:             0 kB\n"
            f"SwapFree:              0 kB\n")
    path = root / "etc/nvidia-stub/meminfo"
    path.parent.mkdir(parents=True, exist_ok=True)
    # in place: the bind mount inside the running host keeps this inode
    with open(path, "w") as handle:
        handle.write(text)
