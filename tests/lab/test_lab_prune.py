"""A year of releases on the lab, then `invoke prune`: rtx01 (podman, NixOS) and spark01 (Docker,
aarch64, a non-root login with sudo's password) take three stand-in releases in turn (lab.image
--release N: a layer of their own each), the way docs/upgrades.md says: the new tag in the
inventory, one host first, verify, then the rest with --serial 1; a bad release fails its gate
on its host and the rollout stops. Then prune --check lists the first release's image with its
size and changes nothing; prune removes it and the bad release, keeps what runs and the
rollback target, and never touches a foreign image or a foreign model in the HF cache; verify
is green, and going back to the previous release needs no pull."""
from __future__ import annotations

import json
import re

import pytest

from tests.lab.conftest import LAB_INVENTORY, deploy_json, invoke, ssh

HOSTS = ("rtx01", "spark01")
ARCH = {"rtx01": "x86_64", "spark01": "aarch64"}
RUNTIME = {"rtx01": "podman", "spark01": "docker"}
CACHE = "/srv/models/hf-cache/hub"
FOREIGN_IMAGE = "localhost/someone/tool:1"
FOREIGN_MODEL = f"{CACHE}/models--someone--foreign"
MODEL = f"{CACHE}/models--nvidia--diffusiongemma-26B-A4B-it-NVFP4"


def refs(option: str) -> dict[str, str]:
    """arch -> the reference lab.image pushed."""
    out = invoke("lab.image", *option.split(), check=True).stdout
    return dict(re.findall(r"^(x86_64|aarch64): (\S+)$", out, re.M))


def set_image(inventory, host: str, ref: str, pull: str = "always"):
    path = inventory / "host_vars" / f"{host}.yml"
    path.parent.mkdir(exist_ok=True)
    kept = [line for line in (path.read_text().splitlines() if path.exists() else [])
            if not line.startswith(("image:", "image_pull:"))]
    path.write_text("\n".join(kept + [f"image: {ref}", f"image_pull: {pull}"]) + "\n")


def deploy(inventory, *args):
    proc, data = deploy_json(*args, inventory=inventory)
    return proc, data


def images_of(host: str) -> set[str]:
    runtime = RUNTIME[host]
    out = ssh(host, f"{runtime} images --format '{{{{.Repository}}}}:{{{{.Tag}}}}'").stdout
    return {line.strip() for line in out.splitlines() if line.strip()}


def prune(inventory, *args):
    proc = invoke("prune", "--hosts", ",".join(HOSTS), "--json", "-", *args, inventory=inventory, timeout=600)
    return proc, json.loads(proc.stdout) if proc.stdout.strip() else {}


@pytest.fixture(scope="module")
def releases(lab):
    made = {n: refs(f"--release {n}") for n in (1, 2, 3)}
    made["bad"] = refs("--fault 500")
    yield made
    # the lab's own images again, for the tests after these
    proc, _ = deploy_json("--hosts", ",".join(HOSTS))
    assert proc.returncode == 0, proc.stdout[-3000:]
    for host in HOSTS:
        ssh(host, f"{RUNTIME[host]} rmi {FOREIGN_IMAGE} >/dev/null 2>&1; rm -rf {FOREIGN_MODEL}", check=False)


def test_releases_rolled_one_host_first_then_pruned_keeping_the_rollback_target(releases, lab_copy):
    inv = lab_copy
    # release 1 on both, one host at a time
    for host in HOSTS:
        set_image(inv, host, releases[1][ARCH[host]])
    proc, _ = deploy(inv, "--hosts", ",".join(HOSTS), "--serial", "1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    for n in (2, 3):
        if n == 3:
            # a bad release tried first on rtx01: its gate fails, rtx01 goes back to release 2, the rollout stops
            set_image(inv, "rtx01", releases["bad"]["x86_64"])
            proc, data = deploy(inv, "--hosts", "rtx01")
            assert proc.returncode == 1 and "rolled back" in proc.stdout, proc.stdout[-3000:]
            running = ssh("rtx01", "podman ps --format '{{.Image}}' --filter name=vllm").stdout
            assert releases[2]["x86_64"] in running, running
        # the new release on rtx01 first, checked; then the rest, one host at a time
        set_image(inv, "rtx01", releases[n]["x86_64"])
        proc, _ = deploy(inv, "--hosts", "rtx01")
        assert proc.returncode == 0, proc.stdout[-3000:]
        assert invoke("verify", "--hosts", "rtx01", inventory=inv).returncode == 0
        set_image(inv, "spark01", releases[n]["aarch64"])
        proc, _ = deploy(inv, "--hosts", ",".join(HOSTS), "--serial", "1")
        assert proc.returncode == 0, proc.stdout[-3000:]

    # what is not the fleet's: an image of another repository, a model nobody deployed, a download left behind
    for host in HOSTS:
        ssh(host, f"{RUNTIME[host]} tag {releases[3][ARCH[host]]} {FOREIGN_IMAGE}")
        ssh(host, f"mkdir -p {FOREIGN_MODEL}/blobs {FOREIGN_MODEL}/snapshots/{'f' * 40} {FOREIGN_MODEL}/refs && "
                  f"head -c 100000 /dev/urandom > {FOREIGN_MODEL}/blobs/w && "
                  f"ln -sf ../../blobs/w {FOREIGN_MODEL}/snapshots/{'f' * 40}/w.bin && "
                  f"echo {'f' * 40} > {FOREIGN_MODEL}/refs/main && "
                  f"head -c 300000 /dev/zero > {MODEL}/blobs/{'e' * 64}.incomplete")

    # status: each replica's rollback target, still on the disk
    status = invoke("status", "--hosts", ",".join(HOSTS), "--json", "-", inventory=inv)
    data = json.loads(status.stdout)
    for host in HOSTS:
        back = data["hosts"][host]["replicas"][0]["rollback"]
        assert back["image"] == releases[2][ARCH[host]] and back["on_disk"] == {"image": True, "weights": True}, back

    before = {host: images_of(host) for host in HOSTS}
    proc, seen = prune(inv, "--check")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert {host: images_of(host) for host in HOSTS} == before  # --check removes nothing
    for host in HOSTS:
        chosen = seen["hosts"][host]["prune"]
        listed = {r["what"]: r for r in chosen["remove"]}
        first = releases[1][ARCH[host]]
        assert first in listed and listed[first]["size"] > 2_000_000 and listed[first]["frees"] >= 2_000_000, listed
        assert releases[2][ARCH[host]] not in listed and releases[3][ARCH[host]] not in listed
        assert not any("someone" in what for what in listed), listed
        assert any(r["kind"] == "partial" for r in chosen["remove"]), listed
        assert f"{host}: would remove image {first}" in proc.stderr  # people's lines: stderr, with --json -
    assert releases["bad"]["x86_64"] in {r["what"] for r in seen["hosts"]["rtx01"]["prune"]["remove"]}

    proc, done = prune(inv)
    assert proc.returncode == 0, proc.stdout[-3000:]
    for host in HOSTS:
        left = images_of(host)
        tag = lambda ref: ref.split("/", 1)[1]  # noqa: E731 (the repository and tag, as both runtimes list them)
        assert not any(tag(releases[1][ARCH[host]]) in i for i in left), left
        assert any(tag(releases[2][ARCH[host]]) in i for i in left) and any(tag(releases[3][ARCH[host]]) in i for i in left)
        assert any("someone/tool:1" in i for i in left), left
        assert ssh(host, f"test -f {FOREIGN_MODEL}/blobs/w && test -L {FOREIGN_MODEL}/snapshots/{'f' * 40}/w.bin "
                         f"&& echo kept").stdout.strip() == "kept"
        assert ssh(host, f"ls {MODEL}/blobs | grep -c incomplete || true").stdout.strip() == "0"
        assert done["hosts"][host]["prune"]["freed"] >= 2_000_000
    assert not any("fault-500" in i for i in images_of("rtx01"))
    # a second prune finds nothing of the releases to remove
    proc, again = prune(inv, "--check")
    for host in HOSTS:
        assert not [r for r in again["hosts"][host]["prune"]["remove"] if r["kind"] == "image"], again["hosts"][host]
    assert invoke("verify", "--hosts", ",".join(HOSTS), inventory=inv).returncode == 0
    # the fleet's disk in monitoring: the node exporter serves the textfile prune wrote
    for host in HOSTS:
        exported = ssh(host, "curl -sS --max-time 5 http://127.0.0.1:9100/metrics | grep '^dgemma_' | "
                             "grep -E 'fleet_disk|prunable'").stdout
        figures = dict(re.findall(r'^(dgemma_\w+\{kind="\w+"\}) (\S+)$', exported, re.M))
        assert float(figures['dgemma_fleet_disk_bytes{kind="images"}']) > 4_000_000, exported
        assert float(figures['dgemma_fleet_disk_bytes{kind="weights"}']) > 0, exported
        assert float(figures['dgemma_prunable_bytes{kind="images"}']) == 0, exported

    # back to release 2, the rollback target: no pull (image_pull: missing finds it here)
    for host in HOSTS:
        set_image(inv, host, releases[2][ARCH[host]], pull="missing")
    proc, data = deploy(inv, "--hosts", ",".join(HOSTS), "--serial", "1")
    assert proc.returncode == 0, proc.stdout[-3000:]
    for host in HOSTS:
        steps = [t for t in data["hosts"][host]["tasks"] if t["role"] == "image"]
        # present: its digest recorded, nothing pulled
        assert [t["task"] for t in steps if t["status"] == "changed"] == [f"record {releases[2][ARCH[host]]}"], steps
        running = ssh(host, f"{RUNTIME[host]} ps --format '{{{{.Image}}}}'").stdout
        assert releases[2][ARCH[host]] in running, running


def test_a_pull_that_cannot_fit_fails_before_it_starts_naming_what_is_missing_and_prune(releases, lab_copy):
    """min_free_disk_mib larger than the disk: the image step asks the registry for the new release's
    size, finds it short, and fails before the pull; nothing of it is on the host, the replica runs on."""
    fresh = refs("--release 4")
    for host in HOSTS:
        running = ssh(host, f"{RUNTIME[host]} ps --format '{{{{.Image}}}}'").stdout
        set_image(lab_copy, host, fresh[ARCH[host]], pull="missing")
        path = lab_copy / "host_vars" / f"{host}.yml"
        path.write_text(path.read_text() + "min_free_disk_mib: 100000000\n")
        proc, data = deploy(lab_copy, "--hosts", host)
        assert proc.returncode == 1, proc.stdout[-3000:]
        failed = [t for t in data["hosts"][host]["tasks"] if t["status"] == "failed"]
        assert [(t["role"], t["task"]) for t in failed] == [("image", "room for the image")], failed
        message = failed[0]["message"]
        assert "MiB missing. Nothing was pulled" in message and f"invoke prune --hosts {host} --check" in message
        assert re.search(r"needs about [0-9,]+ MiB on \S+ \(/var/lib/(containers|docker)\)", message), message
        assert not any(fresh[ARCH[host]].split("/", 1)[1] in i for i in images_of(host))
        assert ssh(host, f"{RUNTIME[host]} ps --format '{{{{.Image}}}}'").stdout == running
        if host == "rtx01":
            # prune_before_pull: what prune would remove goes first (release 1 pulled back here: no release
            # keeps it); the disk is still short by far, so the pull is refused all the same, saying so
            ssh(host, f"podman pull -q --tls-verify=false {releases[1]['x86_64']}")
            path.write_text(path.read_text() + "prune_before_pull: true\n")
            proc, data = deploy(lab_copy, "--hosts", host)
            assert proc.returncode == 1, proc.stdout[-3000:]
            tasks = data["hosts"][host]["tasks"]
            removed = [t for t in tasks if t["role"] == "image" and t["task"].startswith("remove image")]
            assert [t["status"] for t in removed if releases[1]["x86_64"] in t["task"]] == ["changed"], tasks
            failed = [t for t in tasks if t["status"] == "failed"]
            assert "after prune_before_pull freed" in failed[0]["message"], failed
            assert not any(releases[1]["x86_64"].split("/", 1)[1] in i for i in images_of(host))
