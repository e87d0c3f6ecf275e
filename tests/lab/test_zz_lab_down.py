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
    inits = [p for p in machines.processes_in(host) if open(f"/proc/{p}/comm").read().strip() == "systemd"]
    assert len(inits) == 1


def test_lab_down_leaves_no_process_namespace_link_mount_or_registry(lab):
    proc = invoke("lab.down", check=True)
    assert "no host, namespace, link, mount or service left" in proc.stdout
    assert leftovers() == []
