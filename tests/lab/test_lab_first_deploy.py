"""The first deploy from empty caches: each artifact crosses the uplink once per run
(the run's relay), the host behind the bastion fetches for itself and says so, and
progress comes as plain lines without colour codes off a terminal. The whole fleet's roles
onto hosts that never ran anything of ours (as `./run.sh main` on a new machine), and those
hosts serving again after a reboot with no deploy."""
import re
import time

import pytest

from lab import config, crossings, hubdata, machines, services
from tests.lab.conftest import deploy_json, invoke, ssh

NVFP4 = "nvidia/diffusiongemma-26B-A4B-it-NVFP4"
BF16 = "google/diffusiongemma-26B-A4B-it"


def task(data, host, role, name):
    return next(t for t in data["hosts"][host]["tasks"] if t["role"] == role and t["task"].startswith(name))


def checkpoint_files(repo, size_mib):
    return {f.path for f in hubdata.repo_files(repo, size_mib, str(config.CACHE / "hub"))}


@pytest.fixture
def knobs_back():
    yield
    services.set_hub()
    services.set_uplink(rate_mb_s=0, stalled=False)


def test_spark_and_rtx_fetch_each_weights_blob_from_the_hub_once(lab, knobs_back, monkeypatch):
    monkeypatch.setenv("DGEMMA_PROGRESS_S", "1")  # a line a second off a terminal
    services.set_hub(size_mib=64)
    services.set_uplink(rate_mb_s=40)  # long enough for both hosts to be fetching at once
    for name in ("spark01", "rtx01", "h100-01"):
        machines.empty_caches(config.host(name))
    start = crossings.mark()
    proc, data = deploy_json("--hosts", "spark01,rtx01,h100-01")
    assert proc.returncode == 0, proc.stdout[-4000:]
    seen = crossings.since(start)
    nvfp4 = {path: n for (repo, path), n in seen.hub_files.items() if repo == NVFP4}
    assert nvfp4 == {path: 1 for path in checkpoint_files(NVFP4, 64)}, nvfp4
    for host in ("spark01", "rtx01"):
        assert "through the run's relay" in task(data, host, "weights", "download")["message"]
    # behind the bastion, the relay is out of reach: the host fetches for itself, and says so
    probe = task(data, "h100-01", "image", "artifact relay")["message"]
    assert "not reachable from this host: fetching from upstream itself" in probe
    assert {path: n for (repo, path), n in seen.hub_files.items() if repo == BF16} == \
        {path: 1 for path in checkpoint_files(BF16, 64)}
    assert data["relay"]["upstream_fetches"] >= len(nvfp4) + 1  # the NVFP4 files and rtx01's image
    # off a terminal: plain progress lines, no colour codes, no markers
    assert "\x1b" not in proc.stdout and "@bytes" not in proc.stdout
    assert re.search(r"… (spark01|rtx01|h100-01) weights \| [0-9.]+ MiB of 64\.0 MiB \(\d+%\)", proc.stdout), \
        proc.stdout[-3000:]


@pytest.fixture
def four_nodes(lab):
    invoke("lab.up", "--hosts", "4", timeout=1800, check=True)
    yield [f"node{i:02d}" for i in range(1, 5)]
    invoke("lab.up", timeout=1800, check=True)  # back to the default lab: the nodes' disks are given back


def test_four_hosts_of_one_arch_pull_each_layer_and_blob_from_outside_once(four_nodes, knobs_back):
    assert invoke("lab.hub", "--size-mib", "64").returncode == 0
    assert "20 MB/s" in invoke("lab.uplink", "--rate-mb-s", "20").stdout
    for name in four_nodes:
        machines.empty_caches(config.host(name))
    start = crossings.mark()
    proc, data = deploy_json("--hosts", ",".join(four_nodes))
    assert proc.returncode == 0, proc.stdout[-4000:]
    seen = crossings.since(start)
    assert seen.registry_blobs and set(seen.registry_blobs.values()) == {1}, seen.registry_blobs
    assert {path: n for (repo, path), n in seen.hub_files.items() if repo == BF16} == \
        {path: 1 for path in checkpoint_files(BF16, 64)}
    for name in four_nodes:
        assert "through the run's relay" in task(data, name, "weights", "download")["message"]
        # the front door's image too (a multi-arch index: the relay passes every Accept header up)
        pulled = task(data, name, "frontdoor", "pull")["message"]
        assert "through the run's relay" in pulled and "relay failed" not in pulled, pulled
    served = data["relay"]
    # everything that crossed the uplink (weights, the vLLM and front door images) went to all four
    assert served["upstream_bytes"] >= 64 * 2 ** 20 and served["served_bytes"] >= 3.9 * served["upstream_bytes"], served


# a serving host that starts at boot (h100-01, behind the bastion), both gateways and the monitor
NEW_HOSTS = ("h100-01", "gateway01", "gateway02", "monitor01")
# what any role of ours leaves on a host (units, files, sockets, state); none of it on a new host
OURS = "ls -d /run/dgemma* /etc/dgemma /var/lib/dgemma /usr/local/lib/dgemma /etc/systemd/system/*dgemma* " \
       "/etc/systemd/system/*vllm* 2>/dev/null; true"


@pytest.fixture(scope="module")
def new_hosts(lab):
    """Hosts that have never run anything of ours: new disks from the base, booted."""
    invoke("lab.up", "--fresh-hosts", ",".join(NEW_HOSTS), timeout=1800, check=True)
    return NEW_HOSTS


def test_the_whole_fleet_deploys_onto_hosts_that_never_ran_anything_of_ours(new_hosts):
    for name in new_hosts:
        assert ssh(name, OURS).stdout.split() == [], f"{name} is not new"
    proc, data = deploy_json()  # the lab's inventory, every host, as ./run.sh main deploys it
    assert proc.returncode == 0, proc.stdout[-5000:]
    recaps = {host: run["recap"] for host, run in data["hosts"].items()}
    assert set(new_hosts) <= set(recaps) and all(r["failed"] == 0 for r in recaps.values()), recaps
    for name in new_hosts:
        assert recaps[name]["changed"] > 0, (name, recaps[name])
    verify = invoke("verify")
    assert verify.returncode == 0, verify.stdout[-5000:]
    serves = invoke("lab.serves")
    assert serves.returncode == 0 and "the lab serves" in serves.stdout, serves.stdout + serves.stderr


def _boot_again(names):
    """An orderly reboot: each host powered off (systemd stops every unit), then booted; /run is
    a new tmpfs at every boot, as on a real machine."""
    for name in names:
        machines.stop(config.host(name))
    invoke("lab.up", timeout=600, check=True)


def _serving(name) -> bool:
    """The host's units of ours that start at boot are active, and what they make in /run is there."""
    script = ("for u in $(systemctl list-unit-files --state=enabled --no-legend '*dgemma*' '*vllm*' | cut -d' ' -f1);"
              " do systemctl is-active -q \"$u\" || echo \"$u\"; done")
    return ssh(name, script, check=False).stdout.strip() == ""


def test_a_host_rebooted_after_its_first_deploy_serves_again_with_no_deploy(new_hosts):
    rebooted = ("gateway01", "h100-01")
    before = {name: ssh(name, "cat /proc/sys/kernel/random/boot_id").stdout for name in rebooted}
    _boot_again(rebooted)
    for name in rebooted:
        assert ssh(name, "cat /proc/sys/kernel/random/boot_id").stdout != before[name], f"{name} did not reboot"
    deadline = time.monotonic() + 180
    while not all(_serving(name) for name in rebooted) and time.monotonic() < deadline:
        time.sleep(2)
    waiting = {name: ssh(name, "systemctl --failed --no-legend; ls /run", check=False).stdout
               for name in rebooted if not _serving(name)}
    assert not waiting, waiting
    assert ssh("gateway01", "test -S /run/dgemma-gateway/usage.sock", check=False).returncode == 0
    # no deploy in between: what serves is what the boot started. A unit that is active may not
    # answer yet (the gateway sees a front door UP after two checks, the collector writes its first
    # textfiles): verify is asked again until it passes, for a minute at most
    deadline = time.monotonic() + 60
    while (verify := invoke("verify", "--hosts", ",".join(rebooted))).returncode and time.monotonic() < deadline:
        time.sleep(3)
    assert verify.returncode == 0, "\n".join(line for line in verify.stdout.splitlines()
                                             if not line.rstrip().endswith(("pass", "n/a")))[-5000:]
    serves = invoke("lab.serves")
    assert serves.returncode == 0, serves.stdout + serves.stderr
