"""The lab fixture: real nspawn hosts, brought up once per test session."""
import json
import os
import shlex
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
BASTION = next(h for h in config.DEFAULT_HOSTS if h.bastion)
SSH_OPTIONS = ["-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={KNOWN}",
               "-i", str(KEY), "-o", "ConnectTimeout=10"]


def invoke(*args, inventory=LAB_INVENTORY, timeout=900, check=False):
    env = dict(os.environ, DGEMMA_INVENTORY=str(inventory), PYTHONUNBUFFERED="1", COLUMNS="200")
    proc = subprocess.run([sys.executable, "-m", "invoke", *map(str, args)], cwd=ROOT, env=env, text=True,
                          capture_output=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"invoke {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    return proc


# the tests' own commands on a host share one connection to it (OpenSSH's multiplexing): a new
# connection cost spark01's emulated sshd ~0.9 s, a session on a held one ~0.3 s (x86 hosts
# 0.27 s and 0.01 s). The held connection is given up within ~6 s of no answer (a cut link, a
# host gone), so a command sent meanwhile fails as a new connection's would
SHARED_CONNECTION = ["-o", "ControlMaster=auto", "-o", f"ControlPath={config.STATE}/ssh/mux-%C",
                     "-o", "ControlPersist=60", "-o", "ServerAliveInterval=2", "-o", "ServerAliveCountMax=3"]


def ssh_args(host, shared=False) -> list[str]:
    """OpenSSH to a lab host as people reach it: through bastion01 for the private
    network (with this key and known_hosts for the hop too), as its login user;
    ``shared``: over the tests' held connection to it."""
    lab_host = config.host(host)
    args = ["ssh", *SSH_OPTIONS, *(SHARED_CONNECTION if shared else ())]
    if "lab" not in lab_host.networks:
        hop = " ".join(["ssh", *SSH_OPTIONS, "-W", "%h:%p", f"{BASTION.login}@{BASTION.address}"])
        args += ["-o", f"ProxyCommand={hop}"]
    return args + [f"{lab_host.login}@{lab_host.address}"]


CA_FILE = config.CA_FILE


def front_door(host, path, key=None, body=None, timeout=30, address=None, headers=None):
    """A request to a host's front door as a user sends it: https, the certificate checked
    against the lab's fleet CA. Returns (status, body bytes, headers)."""
    import ssl
    import urllib.error
    import urllib.request
    req = urllib.request.Request(f"https://{address or ADDRESS[host]}:8000{path}",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={**({"Authorization": f"Bearer {key}"} if key else {}), **(headers or {})})
    if body is not None:
        req.add_header("Content-Type", "application/json")
    context = ssl.create_default_context(cafile=str(CA_FILE))
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=context) as resp:
            return resp.status, resp.read(), resp.headers
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(), exc.headers


def become_password(host) -> str:
    from lab.rootfs import become_password_file
    return become_password_file(config.host(host)).read_text().strip()


def ssh(host, command, timeout=120, check=True, input=""):
    """Run ``command`` as root on a lab host over SSH, ``input`` on its stdin: a login that
    is not root goes through sudo, its password on sudo's stdin first."""
    lab_host = config.host(host)
    if lab_host.login != "root":
        command, input = "sudo -S -p '' sh -c " + shlex.quote(command), become_password(host) + "\n" + input
    proc = subprocess.run([*ssh_args(host, shared=True), command], text=True, capture_output=True, timeout=timeout,
                          input=input)
    if proc.returncode == 255 and _HELD_CONNECTION_LOST in proc.stderr:
        # the held connection died under this command before it began (its host rebooted): a new one
        proc = subprocess.run([*ssh_args(host), command], text=True, capture_output=True, timeout=timeout,
                              input=input)
    if check and proc.returncode != 0:
        raise AssertionError(f"ssh {host} {command!r}: {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def frontdoor_stats(host, check=False) -> list[dict]:
    """The host's front door stats page as CSV rows (its admin page, a unix socket only root
    reaches); none when it does not answer and ``check`` is false."""
    import csv
    import io
    out = ssh(host, "curl -sS --max-time 3 --unix-socket /run/dgemma-frontdoor/admin-http.sock 'http://x/;csv'",
              check=check).stdout
    return list(csv.DictReader(io.StringIO(out.lstrip("# "))))


# what OpenSSH's client says when the connection it shares died before its session began
_HELD_CONNECTION_LOST = "mux_client_request_session"


def deploy_json(*args, inventory=LAB_INVENTORY, tmp=None):
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "deploy.json"
        proc = invoke("deploy", *args, "--json", out, inventory=inventory)
        data = json.loads(out.read_text()) if out.exists() else None
    return proc, data


@pytest.fixture(scope="session")
def lab(request):
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("the lab needs root on Debian 12")
    from tests.lab import open_webui
    # the browser test's Open WebUI installs meanwhile, at the lowest priority (open_webui.py says why)
    if any(item.nodeid.startswith("tests/lab/test_lab_open_webui.py") for item in request.session.items):
        open_webui.install_in_background()
    request.addfinalizer(open_webui.abandon)
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
