"""Read-only means read-only: `invoke deploy --check` against a deployed lab and a fresh
credentials_dir changes nothing on any host and makes nothing on the control machine (it
says it would make the fleet CA, the certificates and the keys). verify and facts write
nothing either."""
import hashlib
import json
import shlex
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from lab import config
from tests.lab.conftest import become_password, deploy_json, invoke, ssh, ssh_args

HOSTS = ("spark01", "rtx01", "h100-01", "hgx01", "gateway01", "gateway02", "monitor01")
# what deploy manages on a host (the collector's textfiles and the monitoring data change by themselves)
MANAGED = ("/etc/dgemma", "/etc/systemd/system", "/etc/keepalived", "/var/lib/dgemma")
CHANGING = ("/var/lib/dgemma/metrics", "/var/lib/dgemma/prometheus", "/var/lib/dgemma/alertmanager")


def on_every_host(snapshot) -> dict:
    """``snapshot(host)`` of every host, taken side by side (spark01's alone takes ~2.6 s)."""
    with ThreadPoolExecutor(len(HOSTS)) as pool:
        return dict(zip(HOSTS, pool.map(snapshot, HOSTS)))


def tree(host, folders: str, prune: tuple, fields: str) -> str:
    """Each file under ``folders`` (but ``prune``): a line of its path and find's ``fields``, and a
    line of its sha256, from one find and one sha256sum for all (four programs a file took
    spark01's emulated shell 7.8 s for its two trees; this takes 2.8 s)."""
    skip = " -o ".join(f"-path {path}" for path in prune)
    find = f"find {folders} \\( {skip} \\) -prune -o -type f"
    return ssh(host, f"export LC_ALL=C; {find} -printf '%p {fields}\\n' 2>/dev/null | sort; "
                     f"{find} -exec sha256sum {{}} + 2>/dev/null | sort -k 2", check=False).stdout


def host_tree(host) -> str:
    """The sha256 of every file deploy manages on the host, with its mode and owner."""
    return tree(host, " ".join(MANAGED), CHANGING, "%m %u:%g")


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
    before = on_every_host(host_tree)
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
    assert on_every_host(host_tree) == before
    # verify, facts and the render for Kubernetes make nothing there either
    for command in (["verify", "--hosts", "rtx01", "--set", f"credentials_dir={fresh}"],
                    ["facts", "--hosts", "rtx01", "--set", f"credentials_dir={fresh}"],
                    ["render", "--target", "kubernetes", "--out", tmp_path / "k8s", "--hosts", "rtx01", "--set",
                     f"credentials_dir={fresh}"]):
        invoke(*command)
        assert not fresh.exists(), command


# what changes in /run by itself or by any login, not by what we run: systemd and the journal, the
# container runtimes' state, logind's and utmp's sessions, sudo's timestamps (the become's login),
# the message of the day PAM writes at each login
RUN_NOT_OURS = ("/run/systemd", "/run/log", "/run/user", "/run/sudo", "/run/containers", "/run/crun",
                "/run/libpod", "/run/containerd", "/run/docker", "/run/runc", "/run/netns", "/run/utmp",
                "/run/motd.dynamic")


def run_tree(host) -> str:
    """Every file in /run (the host lock's folder, our services' state, pid files) with its mode,
    owner, mtime and sha256, but what changes there by itself (RUN_NOT_OURS)."""
    return tree(host, "/run", RUN_NOT_OURS, "%m %u:%g %T@")


def hold_lock(host) -> subprocess.Popen:
    """The host's lock held as a deploy holds it (the engine's own script), until the process ends
    (its end closes the script's stdin: the host lets the lock go at once)."""
    from converge.hostlock import keep_holding, lock_script
    from roles import LOCK_NAME
    script = lock_script(LOCK_NAME, 0, "a deploy of the read-only test") + keep_holding(600)
    lab_host = config.host(host)
    sudo = lab_host.login != "root"
    command = ("sudo -S -p '' sh -c " if sudo else "sh -c ") + shlex.quote(script)
    proc = subprocess.Popen([*ssh_args(host), command], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if sudo:
        proc.stdin.write(become_password(host) + "\n")
        proc.stdin.flush()
    assert proc.stdout.readline().strip() == "locked", host
    return proc


def test_reads_take_no_lock_write_nothing_and_do_not_wait_for_a_deploy(deployed, tmp_path):
    """With every host's lock held as a deploy holds it: deploy --check, verify, facts, status, top,
    usage, logs and endpoints each answer within seconds (a run that changes a host waits up to 300 s
    for it), the ones that read the hosts' state say which hosts were mid-run, and no file changed
    on any host (/run, where the lock lives, included) nor in the control machine's credentials."""
    held = {host: hold_lock(host) for host in HOSTS}
    try:
        before = on_every_host(lambda host: host_tree(host) + run_tree(host))
        credentials = folder_tree(config.CREDENTIALS)
        took = {}
        for name, args in (("deploy --check", ["deploy", "--check", "--json", tmp_path / "check.json"]),
                           ("verify", ["verify"]), ("facts", ["facts"]), ("status", ["status"]),
                           ("top", ["top", "--once"]), ("usage", ["usage"]), ("logs", ["logs", "--lines", "3"]),
                           ("endpoints", ["endpoints"])):
            started = time.monotonic()
            proc = invoke(*args, timeout=240)
            took[name] = time.monotonic() - started
            assert "for the lock held by" not in proc.stdout, (name, proc.stdout[-2000:])
            if name in ("deploy --check", "verify", "status"):
                assert proc.returncode == 0, (name, proc.stdout[-3000:], proc.stderr[-2000:])
                said = [line for line in proc.stdout.splitlines() if "another run holds its lock" in line]
                assert len(said) == len(HOSTS), (name, proc.stdout[-3000:])
        document = json.loads((tmp_path / "check.json").read_text())
        assert {h: v.get("lock_held_by") for h, v in document["hosts"].items()} == \
            {h: "a deploy of the read-only test" for h in HOSTS}
        assert all(seconds < 120 for seconds in took.values()), took
        assert folder_tree(config.CREDENTIALS) == credentials
        after = on_every_host(lambda host: host_tree(host) + run_tree(host))
        assert after == before, {h: sorted(set(after[h].splitlines()) ^ set(before[h].splitlines()))
                                 for h in HOSTS if after[h] != before[h]}
        print(", ".join(f"{name} {seconds:.0f} s" for name, seconds in took.items()) + " with every lock held")
    finally:
        for proc in held.values():
            proc.kill()
            proc.wait()
