"""The lab fixture: real nspawn hosts, brought up once per test session."""
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lab import config
from tests.conftest import ROOT

LAB_INVENTORY = config.STATE / "inventory"
KEY = config.STATE / "ssh" / "id_ed25519"
KNOWN = config.STATE / "ssh" / "known_hosts"
ADDRESS = {h.name: h.address for h in config.DEFAULT_HOSTS}


def invoke(*args, inventory=LAB_INVENTORY, timeout=900, check=False):
    env = dict(os.environ, DGEMMA_INVENTORY=str(inventory), PYTHONUNBUFFERED="1", COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "invoke", *map(str, args)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"invoke {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


def ssh(host, command, timeout=120, check=True):
    proc = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o",
                           f"UserKnownHostsFile={KNOWN}", "-i", str(KEY), "-o", "ConnectTimeout=10",
                           f"root@{ADDRESS[host]}", command], text=True, capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"ssh {host} {command!r}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def deploy_json(*args, inventory=LAB_INVENTORY, tmp=None):
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "deploy.json"
        proc = invoke("deploy", *args, "--json", out, inventory=inventory)
        data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


@pytest.fixture(scope="session")
def lab():
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("the lab needs root on Debian 12")
    started = time.monotonic()
    invoke("lab.up", timeout=1800, check=True)
    print(f"lab.up took {time.monotonic() - started:.0f} s")
    return LAB_INVENTORY


@pytest.fixture
def lab_copy(lab, tmp_path):
    """A copy of the lab inventory that a test may edit."""
    target = tmp_path / "inventory"
    shutil.copytree(lab, target)
    return target
