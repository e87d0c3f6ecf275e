"""Root filesystems: one Debian 12 base per arch (debootstrap, cached), copied
per host and given that host's identity: name, machine id, SSH host keys, the
lab's authorized key, its GPU profile."""
from __future__ import annotations

import json
import os
import secrets
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from . import config, sh

BASE_VERSION = "9"  # bump when what goes into a base rootfs changes (9: catatonit)
# in a base's folder .building: debootstrap of this BASE_VERSION finished there (a folder without
# it is thrown away)
BOOTSTRAPPED = ".debootstrapped"
YESCRYPT_COST = 1  # chpasswd's --sha-rounds for yescrypt: 1 to 11, Debian's default 5

HOST_PACKAGES = ["debootstrap", "systemd-container", "qemu-user-static", "binfmt-support", "podman", "crun",
                 "conmon", "uidmap", "fuse-overlayfs", "docker-registry", "skopeo", "openssh-client",
                 "iproute2", "iptables", "util-linux", "curl", "python3-pip", "openssl"]

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

# Docker's default seccomp profile is built for the daemon's arch (arm64), while the
# processes of an arm64 host make x86_64 system calls (qemu-user): every container would
# die. The arm64 host's daemon gets this profile instead (docker 20.10 has no daemon-wide
# "unconfined"); x86_64 hosts keep Docker's default.
SECCOMP_ALLOW = '{"defaultAction": "SCMP_ACT_ALLOW"}\n'

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
    """qemu-aarch64 for the arm64 host: F (the interpreter works inside containers
    and chroots) and C (setuid arm64 programs, such as sudo, run with their owner's
    credentials: without it sudo says "effective uid is not 0"). Debian registers
    it without C; multi-arch setups (e.g. tonistiigi/binfmt) use flags POCF."""
    if not Path("/proc/sys/fs/binfmt_misc/status").exists():
        sh.run("mount", "-t", "binfmt_misc", "binfmt_misc", "/proc/sys/fs/binfmt_misc")
    entry = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
    if not entry.exists() or "enabled" not in entry.read_text():
        sh.run("update-binfmts", "--enable", "qemu-aarch64")
    flags = entry.read_text().split("flags:")[1].split("\n")[0].strip()
    if "F" not in flags or "C" not in flags:
        spec = dict(line.split(" ", 1) for line in Path("/usr/share/binfmts/qemu-aarch64").read_text().splitlines()
                    if " " in line)
        registration = (f":qemu-aarch64:M:{spec.get('offset', '0')}:{spec['magic']}:{spec['mask']}:"
                        f"{spec['interpreter']}:{'P' if spec.get('preserve') == 'yes' else ''}OCF")
        entry.write_text("-1")  # unregister, then register again with the flags
        Path("/proc/sys/fs/binfmt_misc/register").write_text(registration)
    if "C" not in entry.read_text().split("flags:")[1].split("\n")[0]:
        raise sh.LabError("binfmt_misc's qemu-aarch64 entry lacks the C flag (setuid programs such as sudo cannot "
                          "run on the arm64 host); reinstall qemu-user-static")


def base_dir(arch: str) -> Path:
    return config.CACHE / f"rootfs-{config.DEB_ARCH[arch]}"


def _stamp(path: Path) -> Path:
    return path / f".dgemma-base-{BASE_VERSION}"


def ensure_bases(arches: list[str], log=print):
    """A finished base rootfs for each of ``arches``; their debootstraps run at once (an arm64
    one spends minutes in its second stage under qemu, an x86_64 one mostly downloading: side by
    side, a cold lab.up waits for the longer alone), then each is finished in order."""
    todo = [arch for arch in arches if not _stamp(base_dir(arch)).exists()]
    if len(todo) > 1:
        with ThreadPoolExecutor(len(todo)) as pool:
            bootstrapped = [pool.submit(_debootstrap, arch, log) for arch in todo]
        for done in bootstrapped:
            done.result()  # the first failure, as ensure_base would have raised it
    for arch in arches:
        ensure_base(arch, log)


def _debootstrap(arch: str, log=print) -> Path:
    """The packages of ``arch``'s base, installed in its folder ``.building`` (kept once whole:
    ``ensure_base`` finishes it)."""
    work = base_dir(arch).with_name(base_dir(arch).name + ".building")
    mark = work / BOOTSTRAPPED
    if mark.exists() and mark.read_text() == BASE_VERSION:
        return work
    shutil.rmtree(work, ignore_errors=True)
    config.CACHE.mkdir(parents=True, exist_ok=True)
    log(f"debootstrap {config.SUITE} {config.DEB_ARCH[arch]} into {work} (once; cached)")
    sh.run("debootstrap", f"--arch={config.DEB_ARCH[arch]}", "--variant=minbase",
           f"--include={','.join(config.PACKAGES)}", config.SUITE, work, config.MIRROR, timeout=1800)
    mark.write_text(BASE_VERSION)  # of this version's packages
    return work


def ensure_base(arch: str, log=print) -> Path:
    """A finished base rootfs for ``arch``; a half-built one is thrown away."""
    final = base_dir(arch)
    if _stamp(final).exists():
        return final
    work = _debootstrap(arch, log)
    (work / BOOTSTRAPPED).unlink()
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
    _write(root, "/etc/docker/seccomp-allow.json", SECCOMP_ALLOW)
    _write(root, "/etc/systemd/system/nvidia-stub-meminfo.service", MEMINFO_UNIT)
    wants = root / "etc/systemd/system/sysinit.target.wants"
    wants.mkdir(parents=True, exist_ok=True)
    link = wants / "nvidia-stub-meminfo.service"
    if not link.is_symlink():
        link.symlink_to("/etc/systemd/system/nvidia-stub-meminfo.service")
    # units that cannot work in a container and only make the state "degraded"
    # haproxy.service, prometheus-node-exporter*: the packages are there for the images, not to run on the hosts
    for unit in ("systemd-networkd-wait-online.service", "apt-daily.timer", "apt-daily-upgrade.timer",
                 "e2scrub_all.timer", "fstrim.timer", "haproxy.service", "prometheus-node-exporter.service",
                 "prometheus-node-exporter-apt.timer", "prometheus-node-exporter-ipmitool-sensor.timer",
                 "prometheus-node-exporter-mellanox-hca-temp.timer", "prometheus-node-exporter-nvme.timer",
                 "prometheus-node-exporter-smartmon.timer"):
        mask = root / "etc/systemd/system" / unit
        if not mask.exists():
            mask.symlink_to("/dev/null")
    for unit in ("docker.service", "docker.socket", "containerd.service"):  # started per host, when wanted
        (root / "etc/systemd/system/multi-user.target.wants" / unit).unlink(missing_ok=True)
        (root / "etc/systemd/system/sockets.target.wants" / unit).unlink(missing_ok=True)
    shutil.rmtree(root / "var/cache/apt/archives", ignore_errors=True)
    (root / "var/cache/apt/archives/partial").mkdir(parents=True, exist_ok=True)


def _native_runtime(root: Path):
    """An arm64 crun or runc cannot run under qemu-user, nor containerd's arm64
    shim: give the arm64 podman the machine's native crun and conmon, and the
    arm64 Docker engine native runc and shim, with their libraries (LAB-NOTES.md).
    runc and the shim come from the x86_64 base (the machine has no Docker engine)."""
    amd64 = ensure_base("x86_64")
    target = root / "opt/x86/bin"
    target.mkdir(parents=True, exist_ok=True)
    # nsenter for the GPU stand-in's hook: setns into a mount namespace fails (EINVAL) from
    # a multi-threaded process, which every program under qemu-user is
    tools = [(Path("/"), shutil.which(t) or f"/usr/bin/{t}", target / t) for t in ("crun", "conmon", "nsenter")]
    tools += [(amd64, "/usr/sbin/runc", target / "runc"),
              (amd64, "/usr/bin/containerd-shim-runc-v2", root / "usr/bin/containerd-shim-runc-v2")]
    for src_root, path, dest in tools:
        dest.unlink(missing_ok=True)
        shutil.copy2(src_root / path.lstrip("/"), dest)
        ldd = ("chroot", src_root, "ldd", path) if str(src_root) != "/" else ("ldd", path)
        for line in sh.run(*ldd).stdout.splitlines():
            parts = line.split("=>")
            lib = (parts[1] if len(parts) > 1 else parts[0]).strip().split(" (")[0].strip()
            if lib.startswith("/"):
                lib_dest = root / lib.lstrip("/")
                lib_dest.parent.mkdir(parents=True, exist_ok=True)
                if not lib_dest.exists():
                    shutil.copy2(os.path.realpath(src_root / lib.lstrip("/")), lib_dest)


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
    if not machine_id.is_file() or len(machine_id.read_text().strip()) != 32:
        machine_id.write_text(os.urandom(16).hex() + "\n")
    for keytype in ("ed25519", "rsa"):
        key = root / f"etc/ssh/ssh_host_{keytype}_key"
        if not key.exists():
            sh.run("ssh-keygen", "-q", "-t", keytype, "-N", "", "-C", f"root@{host.name}", "-f", key)
    pub = lab_key().with_suffix(".pub").read_text()
    _write(root, "/root/.ssh/authorized_keys", pub, 0o600)
    (root / "root/.ssh").chmod(0o700)
    # as the seeds' machines: root logs in with a key on the lab's own hosts; a DGX Spark
    # and a bastion are reached as their user, root's SSH login off
    _write(root, "/etc/ssh/sshd_config.d/dgemma-lab.conf",
           f"PasswordAuthentication no\nPermitRootLogin {'prohibit-password' if host.login == 'root' else 'no'}\n"
           "UseDNS no\nMaxStartups 100:30:200\nMaxSessions 64\n")
    if host.login != "root":
        _login_user(root, host, pub)
    if host.arch == "aarch64":
        _native_runtime(root)
    _docker(root, host)
    if host.has_gpu:
        _install_gpu_standin(root, host)


def become_password_file(host: config.LabHost) -> Path:
    """Where the lab keeps a login user's sudo password (0600), for become_password_file."""
    return config.STATE / "secrets" / f"{host.name}-become"


def _login_user(root: Path, host: config.LabHost, pub: str):
    """The user people log in as: the lab's key, sudo that asks this user's
    password (a random one, kept 0600 on this machine), docker as DGX OS sets it."""
    user = host.login
    if f"\n{user}:" not in "\n" + (root / "etc/passwd").read_text():
        groups = "sudo" if host.bastion else "sudo,docker"
        sh.run("chroot", root, "useradd", "--create-home", "--shell", "/bin/bash", "--groups", groups, user)
    if not host.bastion:
        secret = become_password_file(host)
        secret.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not secret.exists():
            fd = os.open(secret, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as handle:
                handle.write(secrets.token_urlsafe(18) + "\n")
        # on chpasswd's stdin: the password is on no command line. yescrypt as on DGX OS, at
        # its lowest cost: under qemu-user the default cost took 0.5 s of every sudo (each
        # of become's round trips), where the real machine takes a few tens of ms
        sh.run("chroot", root, "chpasswd", "--crypt-method", "YESCRYPT", "--sha-rounds", str(YESCRYPT_COST),
               input=f"{user}:{secret.read_text().strip()}\n")
    entry = next(line for line in (root / "etc/passwd").read_text().splitlines() if line.startswith(user + ":"))
    uid, gid, home = int(entry.split(":")[2]), int(entry.split(":")[3]), entry.split(":")[5]
    ssh_dir = root / home.lstrip("/") / ".ssh"
    _write(root, f"{home}/.ssh/authorized_keys", pub, 0o600)
    ssh_dir.chmod(0o700)
    for path in (ssh_dir, ssh_dir / "authorized_keys"):
        os.chown(path, uid, gid)


def _docker(root: Path, host: config.LabHost):
    """The Docker engine's configuration, and whether it starts at boot. The
    arm64 host needs what LAB-NOTES.md found (no iptables under qemu, native runc
    and shim, the seccomp profile above); a GPU host gets the nvidia runtime as
    `nvidia-ctk runtime configure --runtime=docker` writes it."""
    daemon: dict = {"insecure-registries": [config.REGISTRY]}
    if host.arch == "aarch64":
        daemon.update({"iptables": False, "bridge": "none", "default-runtime": "runcx86",
                       "runtimes": {"runcx86": {"path": "/opt/x86/bin/runc"}},
                       "seccomp-profile": "/etc/docker/seccomp-allow.json"})
    if host.has_gpu:
        daemon.setdefault("runtimes", {})["nvidia"] = {"args": [], "path": "nvidia-container-runtime"}
    _write(root, "/etc/docker/daemon.json", json.dumps(daemon, indent=2) + "\n")
    wants = root / "etc/systemd/system/multi-user.target.wants"
    for unit in ("docker.service", "containerd.service"):
        link = wants / unit
        link.unlink(missing_ok=True)
        if host.docker:
            link.symlink_to(f"/lib/systemd/system/{unit}")


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
        held = json.loads(state.read_text() or "{}").get("held_mib", 0)
        write_meminfo(root, profile, held_mib=held)
        mounts.append({"hostPath": "/etc/nvidia-stub/meminfo", "containerPath": "/proc/meminfo",
                       "options": ["ro", "bind"]})
    else:
        meminfo.unlink(missing_ok=True)
    # a real CDI spec, as nvidia-ctk writes one: a device per GPU by index and by uuid, and
    # "all"; what it mounts is the stand-in, and per GPU a marker that makes the stand-in show
    # a container only the GPUs it was handed (a real container sees only its device nodes)
    markers = root / "etc/nvidia-stub/devices"
    shutil.rmtree(markers, ignore_errors=True)
    markers.mkdir(parents=True)
    devices = [{"name": "all", "containerEdits": {"env": ["NVIDIA_VISIBLE_DEVICES=void"]}}]
    for index, gpu in enumerate(profile.get("gpus") or [{"uuid": profile["uuid"]}]):
        (markers / gpu["uuid"]).write_text(f"{index}\n")
        edits = {"env": ["NVIDIA_VISIBLE_DEVICES=void"],
                 "mounts": [{"hostPath": f"/etc/nvidia-stub/devices/{gpu['uuid']}",
                             "containerPath": f"/etc/nvidia-visible/{gpu['uuid']}", "options": ["ro", "bind"]}]}
        devices += [{"name": str(index), "containerEdits": edits}, {"name": gpu["uuid"], "containerEdits": edits}]
    cdi = {"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": devices,
           "containerEdits": {"env": ["NVIDIA_STUB=1"], "mounts": mounts}}
    _write(root, "/etc/cdi/nvidia.yaml", json.dumps(cdi, indent=2) + "\n")
    (root / "var/lib/nvidia-stub/apps").mkdir(parents=True, exist_ok=True)
    # Docker's --gpus: NVIDIA's runtime hook (found on PATH by dockerd) and the nvidia runtime
    for name in ("nvidia-container-runtime-hook", "nvidia-container-runtime"):
        _write(root, f"/usr/bin/{name}", (config.HERE / "stubs" / name).read_text(), 0o755)


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
