"""Read-only means read-only: `invoke deploy --check` against a deployed lab and a fresh
credentials_dir changes nothing on any host and makes nothing on the control machine (it
says it would make the fleet CA, the certificates and the keys). verify and facts write
nothing either."""
import hashlib

import pytest

from lab import config
from tests.lab.conftest import deploy_json, invoke, ssh

HOSTS = ("spark01", "rtx01", "h100-01", "hgx01", "gateway01", "gateway02", "monitor01")
# what deploy manages on a host (the collector's textfiles and the monitoring data change by themselves)
MANAGED = ("/etc/dgemma", "/etc/systemd/system", "/etc/keepalived", "/var/lib/dgemma")
CHANGING = ("/var/lib/dgemma/metrics", "/var/lib/dgemma/prometheus", "/var/lib/dgemma/alertmanager")


def host_tree(host) -> str:
    """The sha256 of every file deploy manages on the host, with its mode and owner."""
    prune = " -o ".join(f"-path {path}" for path in CHANGING)
    return ssh(host, "find " + " ".join(MANAGED) + f" \\( {prune} \\) -prune -o -type f -print "
                     "2>/dev/null | sort | while read -r f; do stat -c '%a %U:%G' \"$f\" | tr '\\n' ' '; "
                     "sha256sum < \"$f\" | sed \"s|-|$f|\"; done", check=False).stdout


def folder_tree(folder) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() + oct(p.stat().st_mode)
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def deployed(lab):
    proc, _ = deploy_json()
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


def test_a_check_with_a_fresh_credentials_folder_changes_nothing(deployed, tmp_path):
    """(A real deploy with a fresh folder makes them: tests/test_read_only.py. Not here: the lab's
    hosts serve the other tests meanwhile, whose keys and CA a fresh folder would replace.)"""
    fresh = tmp_path / "credentials"
    before = {host: host_tree(host) for host in HOSTS}
    lab_credentials = folder_tree(config.CREDENTIALS)
    proc, data = deploy_json("--check", "--set", f"credentials_dir={fresh}")
    assert proc.returncode == 0, proc.stdout[-3000:]
    said = {h: [t["message"] for t in v["tasks"] if t["task"] == "fleet credentials"] for h, v in data["hosts"].items()}
    assert all(said[h] and said[h][0].startswith(f"would make the fleet CA in {fresh}/ca") for h in HOSTS), said
    assert "the gateway key" in said["gateway01"][0] and "the monitoring key" in said["monitor01"][0]
    # and it plans the rest with what a deploy would make: new certificates for every front door
    assert [t for t in data["hosts"]["rtx01"]["tasks"] if t["task"] == "front door certificate"][0]["status"] \
        == "changed"
    assert not fresh.exists(), sorted(folder_tree(fresh)) if fresh.exists() else None
    assert folder_tree(config.CREDENTIALS) == lab_credentials
    assert {host: host_tree(host) for host in HOSTS} == before
    # verify, facts and the render for Kubernetes make nothing there either
    for command in (["verify", "--hosts", "rtx01", "--set", f"credentials_dir={fresh}"],
                    ["facts", "--hosts", "rtx01", "--set", f"credentials_dir={fresh}"],
                    ["render", "--target", "kubernetes", "--out", tmp_path / "k8s", "--hosts", "rtx01", "--set",
                     f"credentials_dir={fresh}"]):
        invoke(*command)
        assert not fresh.exists(), command
