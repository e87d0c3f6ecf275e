"""The first deploy from empty caches: each artifact crosses the uplink once per run
(the run's relay), the host behind the bastion fetches for itself and says so, and
progress comes as plain lines without colour codes off a terminal."""
import re

import pytest

from lab import config, crossings, hubdata, machines, services
from tests.lab.conftest import deploy_json, invoke

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
