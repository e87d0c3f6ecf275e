"""Booting and stopping hosts: systemd-nspawn with real systemd as PID 1.

There is no systemd on the machine itself, so nspawn runs with
``--register=no --keep-unit`` as a process of its own session, and the lab
keeps its PID.
"""
from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import time

from . import config, sh


# Each host's systemd, journald and logind take inotify instances from one per-user pool
# (root's, shared by all hosts); the kernel's default of 128 runs out at about 20 hosts, and
# the next host's systemd then fails with "Failed to create inotify object: Too many open files".
INOTIFY_LIMITS = {"/proc/sys/fs/inotify/max_user_instances": 16,  # per host
                  "/proc/sys/fs/inotify/max_user_watches": 8192}


def raise_inotify_limits(count: int):
    """Raise the inotify limits (never lower them) for ``count`` hosts."""
    for path, per_host in INOTIFY_LIMITS.items():
        want = 128 + per_host * count
        try:
            with open(path) as handle:
                current = int(handle.read())
            if current < want:
                with open(path, "w") as handle:
                    handle.write(f"{want}\n")
        except (OSError, ValueError) as exc:
            raise sh.LabError(f"cannot raise {path} to {want} for {count} hosts ({exc}); "
                              f"run: sysctl -w {path[len('/proc/sys/'):].replace('/', '.')}={want}") from exc


def pid_file(host: config.LabHost):
    return host.dir / "nspawn.pid"


def running_pid(host: config.LabHost) -> int | None:
    try:
        pid = int(pid_file(host).read_text())
    except (OSError, ValueError):
        return None
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            cmd = handle.read().split(b"\0")
    except OSError:
        return None
    return pid if cmd and b"systemd-nspawn" in cmd[0] and str(host.root).encode() in cmd else None


def processes_in(host: config.LabHost) -> list[int]:
    """Every process of this host: those whose root is its rootfs (its systemd) and
    those in its network namespace (all its services and host-network containers,
    whose root is an overlay we cannot see from here)."""
    try:
        netns = os.stat(f"/run/netns/{host.netns}").st_ino
    except OSError:
        netns = None
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.readlink(f"/proc/{entry}/root") == str(host.root) or (
                    netns and os.stat(f"/proc/{entry}/ns/net").st_ino == netns):
                found.append(int(entry))
        except OSError:
            continue
    return found


def nspawn_leftovers() -> list[int]:
    """Processes still inside some nspawn payload (cgroup /payload/...), whatever host."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cgroup") as handle:
                    inside = ":/payload" in handle.read()
                with open(f"/proc/{entry}/stat") as handle:
                    zombie = handle.read().rsplit(")", 1)[1].split()[0] == "Z"
                if inside and not zombie:
                    found.append(int(entry))
            except OSError:
                continue
    return found


def _kill_orphans(host: config.LabHost):
    """A killed nspawn leaves the host's systemd and services running with no one
    to stop them; a second boot on the same disk must never meet them."""
    for _ in range(20):
        pids = processes_in(host)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        time.sleep(0.25)
    raise sh.LabError(f"{host.name}: processes {processes_in(host)} survive SIGKILL")


def crash(host: config.LabHost):
    """The power goes: nspawn and every process of the host killed at once (SIGKILL),
    no shutdown, and its links dark (network.power_lost). `lab.up` boots it again (its disk
    as the crash left it)."""
    from . import network
    pid = running_pid(host)
    if pid:
        os.killpg(pid, signal.SIGKILL)
    network.power_lost(host)
    _kill_orphans(host)


def release_disk(host: config.LabHost):
    """Before a host's disk is replaced: its processes gone, its mounts undone."""
    if running_pid(host):
        stop(host)
    _kill_orphans(host)
    _clear_stale_mounts(host)


def boot(host: config.LabHost):
    if running_pid(host):
        return
    _kill_orphans(host)
    _clear_stale_mounts(host)
    log = open(host.dir / "console.log", "ab")
    # a writable cgroup v2 tree: the Docker engine needs it to run containers (LAB-NOTES.md)
    env = dict(os.environ, SYSTEMD_NSPAWN_API_VFS_WRITABLE="1", SYSTEMD_NSPAWN_TMPFS_TMP="0",
               SYSTEMD_NSPAWN_UNIFIED_HIERARCHY="1")
    args = ["systemd-nspawn", "-q", "-D", str(host.root), "-b", "-M", host.name,
            f"--network-namespace-path=/run/netns/{host.netns}", "--register=no", "--keep-unit",
            "--capability=all", "--system-call-filter=@keyring bpf", "--console=read-only",
            "--resolv-conf=off", "--timezone=off", "--link-journal=no"]
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                            start_new_session=True)
    pid_file(host).write_text(str(proc.pid))


_BANNER = ("import socket, sys\n"
           "try:\n"
           "    c = socket.create_connection((sys.argv[1], 22), timeout=2); c.settimeout(5)\n"
           "    sys.exit(0 if c.recv(64).startswith(b'SSH-') else 1)\n"
           "except OSError:\n"
           "    sys.exit(1)\n")


def wait_ssh(host: config.LabHost, timeout: float = 120) -> float:
    """Seconds until sshd answers with its banner (asked from inside the host's own
    network namespace: a host of the private network cannot be reached from here)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if not running_pid(host):
            tail = (host.dir / "console.log").read_text(errors="replace")[-1500:]
            raise sh.LabError(f"{host.name}: systemd-nspawn exited during boot:\n{tail}")
        if sh.run("ip", "netns", "exec", host.netns, sys.executable, "-c", _BANNER, host.address,
                  check=False, timeout=15).returncode == 0:
            return time.monotonic() - started
        time.sleep(0.5)
    raise sh.LabError(f"{host.name}: sshd did not answer on {host.address}:22 within {timeout:g} s; "
                      f"see {host.dir / 'console.log'}")


# units that failed to start for a reason of the boot's moment, not their own: under nspawn,
# systemd sometimes cannot make a unit's cgroup while a dozen hosts boot at once (status
# 219/CGROUP; seen on bastion01's systemd-user-sessions, which then leaves /run/nologin and
# refuses every user but root: the bastion's jump user, spark01's sudo user)
_RESTART_FAILED_AT_BOOT = r"""
for unit in $(systemctl list-units --state=failed --plain --no-legend --no-pager | awk '{print $1}'); do
  status=$(systemctl show -p ExecMainStatus --value "$unit"); result=$(systemctl show -p Result --value "$unit")
  if [ "$status" = 219 ] || [ "$result" = resources ]; then
    systemctl reset-failed "$unit"
    if systemctl restart "$unit"; then echo "restarted $unit"; else echo "still failed $unit"; fi
  fi
done
"""


def restart_units_failed_at_boot(host: config.LabHost) -> list[str]:
    """Each unit of the host that failed to start for want of its cgroup or another resource,
    started again; what was done, a line each ("restarted U" or "still failed U")."""
    proc = console(host, _RESTART_FAILED_AT_BOOT, timeout=120, check=False)
    return [line for line in proc.stdout.splitlines() if line.startswith(("restarted ", "still failed "))]


def init_pid(host: config.LabHost) -> int | None:
    """The host's PID 1 (its systemd), as this machine numbers it."""
    for pid in processes_in(host):
        try:
            with open(f"/proc/{pid}/status") as handle:
                nspid = next((line.split()[1:] for line in handle if line.startswith("NSpid:")), [])
            # one PID namespace down: a host-network container's first process is PID 1 of
            # its own namespace too, one further down (this machine's, the host's, its own)
            if len(nspid) == 2 and nspid[-1] == "1":
                return pid
        except OSError:
            continue
    return None


def console(host: config.LabHost, command: str, timeout: float = 120, input: str | None = None,
            check: bool = True):
    """Run ``command`` (sh) as root on the host's console: inside all its
    namespaces, whatever its network or SSH settings allow. For the lab's own
    work and for tests that inspect a host; the toolkit itself always uses SSH."""
    pid = init_pid(host)
    if pid is None:
        raise sh.LabError(f"{host.name} is not running: invoke lab.up")
    return sh.run("nsenter", "-t", pid, "-a", "-r", "-w", "/bin/sh", "-c", command, timeout=timeout, input=input,
                  check=check)


def request_poweroff(host: config.LabHost):
    """Ask the host to power off and return at once (lab.down asks every host first, then
    waits for each: their shutdowns overlap instead of following one another)."""
    pid = running_pid(host)
    if pid:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def stop(host: config.LabHost, timeout: float = 60):
    """Orderly poweroff (nspawn passes SIGTERM on as SIGRTMIN+3 to systemd), then kill."""
    pid = running_pid(host)
    if pid:
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and running_pid(host):
            time.sleep(0.5)
        if running_pid(host):
            os.killpg(pid, signal.SIGKILL)
            time.sleep(1)
    pid_file(host).unlink(missing_ok=True)
    _kill_orphans(host)
    _clear_stale_mounts(host)


def _clear_stale_mounts(host: config.LabHost):
    """Mounts under the host's root left by a killed nspawn (a crash or a half-finished up)."""
    for target in reversed(mounts_under(str(host.root))):
        sh.run("umount", "-l", target, check=False)


def mounts_under(prefix: str) -> list[str]:
    found = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            target = line.split()[4]
            if target == prefix or target.startswith(prefix.rstrip("/") + "/"):
                found.append(target)
    return found


def empty_caches(host: config.LabHost, model_cache: str = "/srv/models/hf-cache"):
    """The host as before its first deploy's downloads: no vLLM container or image
    in either runtime, no model cache (units and settings stay)."""
    console(host, "for rt in podman docker; do command -v $rt >/dev/null || continue; "
                  "[ $rt = docker ] && ! systemctl -q is-active docker && continue; "
                  "systemctl stop \"$rt-vllm-*.service\" 2>/dev/null; "
                  "$rt rm -f $($rt ps -aq --filter name=^vllm- 2>/dev/null) >/dev/null 2>&1; "
                  "$rt image prune -af >/dev/null 2>&1; done; "
                  f"rm -rf {shlex.quote(model_cache)}", timeout=300, check=False)
