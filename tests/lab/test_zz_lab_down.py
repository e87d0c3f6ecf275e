"""Last: a crashed host recovers on lab.up; lab.down leaves nothing behind."""
import os
import signal
import time

from lab import config, machines
from lab.tasks import leftovers
from tests.lab.conftest import invoke, ssh


def test_lab_up_recovers_after_a_crash(lab):
    host = config.DEFAULT_HOSTS[1]
    pid = machines.running_pid(host)
    os.killpg(pid, signal.SIGKILL)  # a crash: no orderly shutdown
    time.sleep(1)
    invoke("lab.up", check=True)
    assert ssh(host.name, "hostname").stdout.strip() == host.name
    # the crashed instance's processes are gone: one systemd per host disk
    inits = [p for p in machines.processes_in(host) if command_name(p) == "systemd"]
    assert len(inits) == 1


def command_name(pid: int) -> str:
    """A process's name, or "" when it exited after the listing (a unit's short-lived
    child, for one): such a process is no crashed instance's init."""
    try:
        with open(f"/proc/{pid}/comm") as comm:
            return comm.read().strip()
    except OSError:
        return ""


def test_lab_down_leaves_no_process_namespace_link_mount_or_registry(lab):
    proc = invoke("lab.down", check=True)
    assert "no host, namespace, link, mount or service left" in proc.stdout
    assert leftovers() == []
