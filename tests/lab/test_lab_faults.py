"""Faults injected for real on the lab, each measured into docs/RELIABILITY.md:
a link that drops mid-command, a host that reboots mid-deploy, Ctrl-C and SIGTERM
at step boundaries, disks that fill, a hub and a registry that stop answering, a
corrupt blob, a wedged nvidia-smi, an sshd too slow to answer. After each: the
host failed clearly (or the run stopped with its recap), nothing was left
half-written, no lock is held, and the next deploy converges."""
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from lab import config, machines, services, sh
from tests import reliability
from tests.lab.conftest import (LAB_INVENTORY, ROOT, deploy_json, front_door, frontdoor_stats, invoke, ssh,
                                ssh_args)

RTX = config.host("rtx01")
UNIT = "/etc/systemd/system/podman-vllm-diffusiongemma.service"
ENV = "/etc/dgemma/vllm-diffusiongemma.env"
CACHE = "/srv/models/hf-cache"
BLOBS = f"{CACHE}/hub/models--nvidia--diffusiongemma-26B-A4B-it-NVFP4/blobs"


@pytest.fixture
def clean_links(lab):
    """Whatever a test breaks, the next one starts from a working lab."""
    yield
    sh.run("ip", "link", "set", RTX.veth, "up", check=False)
    services.set_uplink(rate_mb_s=0, stalled=False)
    services.set_hub()
    services.ensure_registry()
    machines.console(RTX, "systemctl kill -s CONT --kill-whom=main ssh.service; true", check=False)
    invoke("lab.gpu", "--host", "rtx01", "--clear")


class Run:
    """`invoke deploy` in the background, its output read line by line."""

    def __init__(self, *args, inventory=LAB_INVENTORY):
        self.json = Path(tempfile.mkdtemp()) / "deploy.json"
        env = dict(os.environ, DGEMMA_INVENTORY=str(inventory), PYTHONUNBUFFERED="1", COLUMNS="200")
        self.proc = subprocess.Popen([sys.executable, "-m", "invoke", "deploy", *args, "--json", str(self.json)],
                                     cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []

    def until(self, words: str, timeout: float = 300) -> str:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            self.lines.append(line)
            if words in line:
                return line
            if time.monotonic() > deadline:
                break
        raise AssertionError(f"no line with {words!r}:\n{''.join(self.lines)[-3000:]}")

    def finish(self, timeout: float = 600):
        out, _ = self.proc.communicate(timeout=timeout)
        self.lines.append(out)
        data = json.loads(self.json.read_text()) if self.json.exists() else None
        return self.proc.returncode, "".join(self.lines), data


def failure(data, host="rtx01"):
    return next(t for t in data["hosts"][host]["tasks"] if t["status"] in ("failed", "unreachable", "interrupted"))


def wait_for(check, timeout=120, every=0.3):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(every)
    raise AssertionError(f"waited {timeout} s for {check.__doc__ or check}")


def downloading():
    """a partial blob of the checkpoint on rtx01, with data in it (the small files before it
    are partial for a moment only: a fault then could fall between two files)"""
    out = ssh("rtx01", f"find {BLOBS} -name '*.incomplete' -size +256k 2>/dev/null | grep -c .; true",
              check=False).stdout.strip()
    return out not in ("", "0")


def hub_gets(name="model.safetensors", since=0.0):
    rows = [json.loads(line) for line in services.HUB_LOG.read_text().splitlines() if line.strip()]
    return [r for r in rows if r["method"] == "GET" and r["path"].endswith("/" + name) and r["t"] >= since]


def leftovers(host="rtx01") -> str:
    """temporary files of atomic writes, a lock still held"""
    temps = ssh(host, "ls -A /etc/systemd/system /etc/dgemma /var/lib/dgemma 2>/dev/null | grep '^\\.' || true").stdout
    lock = ssh(host, "flock -n /run/lock/dgemma.lock true && echo free || echo held").stdout.strip()
    return temps.strip() + ("" if lock == "free" else " lock held")


def lock_released(host="rtx01", within=70) -> float:
    """Seconds until the host lets the lock of a run it lost go (it hears the connection's end,
    or no heartbeat comes within its patience)."""
    started = time.monotonic()
    while ssh(host, "flock -n /run/lock/dgemma.lock true && echo free || echo held").stdout.strip() != "free":
        assert time.monotonic() - started < within, f"the lock is still held after {within} s"
        time.sleep(1)
    return time.monotonic() - started


def roll_ended(host="rtx01", within=120) -> None:
    """Until no roll is under way on the host (its front door's flags all down). A roll whose
    script reached the host only as the link came back (TCP delivered what the lost run had sent)
    runs to its end on its own, as roll.sh means to; the next deploy is run after it, not beside it."""
    started = time.monotonic()
    while True:
        rows = frontdoor_stats(host)
        raised = [r["svname"] for r in rows
                  if r["pxname"] == "rolling" and r["svname"] != "BACKEND" and not r["status"].startswith("MAINT")]
        if rows and not raised:
            return
        assert time.monotonic() - started < within, f"a roll is still under way on {host} ({raised})"
        time.sleep(1)


def converges(inventory=LAB_INVENTORY, host="rtx01", *args):
    proc, data = deploy_json("--hosts", host, *args, inventory=inventory)
    assert proc.returncode == 0, proc.stdout[-3000:]
    proc, data = deploy_json("--hosts", host, "--set", "image_pull=missing", inventory=inventory)
    assert proc.returncode == 0 and data["hosts"][host]["recap"]["changed"] == 0, proc.stdout[-3000:]
    return True


def test_the_link_drops_during_the_weights_download_and_comes_back(clean_links):
    services.set_hub(size_mib=64)
    services.set_uplink(rate_mb_s=6)
    ssh("rtx01", f"rm -rf {CACHE}/hub")
    run = Run("--hosts", "rtx01")
    wait_for(downloading)
    dropped = time.monotonic()
    sh.run("ip", "link", "set", RTX.veth, "down")
    rc, out, data = run.finish(300)
    detected = time.monotonic() - dropped
    seen = failure(data)
    assert rc != 0 and seen["status"] == "unreachable" and "no answer from 10.213.0.12" in seen["message"], out[-2000:]
    sh.run("ip", "link", "set", RTX.veth, "up")
    services.set_uplink(rate_mb_s=0)
    held = lock_released()
    assert converges()
    # whole and verified: no partial blob, every blob's sha256 is its name (the weights role checked them)
    assert ssh("rtx01", f"ls {BLOBS} | grep -c incomplete || true").stdout.strip() == "0"
    assert leftovers() == ""
    reliability.record("fault-link-download", "fault", "the link drops during the weights download",
                       "rtx01's veth down while a 64 MiB blob comes at 6 MB/s, up again after the failure",
                       detected, seen["message"],
                       "a partial blob; the download already under way on the host ran to its end there once the "
                       f"link was back (its curl's own retries); the lost run's lock went {held:.0f} s after the link "
                       f"was back; the next deploy verified every blob and converged", True)


def test_the_link_drops_as_the_unit_is_written(clean_links, lab_copy):
    before = ssh("rtx01", f"sha256sum < {UNIT}").stdout.split()[0]
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("max_num_seqs: 7\n")
    run = Run("--hosts", "rtx01", "--set", "image_pull=missing", inventory=lab_copy)
    run.until("image in force")  # the next step is the rolling restart, which writes the unit
    dropped = time.monotonic()
    sh.run("ip", "link", "set", RTX.veth, "down")
    rc, out, data = run.finish(300)
    detected = time.monotonic() - dropped
    seen = failure(data)
    sh.run("ip", "link", "set", RTX.veth, "up")
    time.sleep(2)
    after = ssh("rtx01", f"sha256sum < {UNIT}; grep -c 'max-num-seqs 7' {UNIT} || true").stdout.split()
    assert rc != 0 and seen["status"] in ("unreachable", "failed"), out[-2000:]
    assert "internal error" not in seen["message"], seen["message"]  # a lost link is the host's, said as such
    written = after[0] != before  # the write reached the host before the link went, or not: whole either way
    assert (written and after[-1] == "1") or (not written and after[-1] == "0")
    held = lock_released()
    assert leftovers() == ""
    roll_ended()
    assert converges(lab_copy)
    assert "max-num-seqs 7" in ssh("rtx01", f"cat {UNIT}").stdout
    assert deploy_json("--hosts", "rtx01")[0].returncode == 0
    reliability.record("fault-link-unit", "fault", "the link drops as the unit file is written",
                       "rtx01's veth down the moment the step before it is reported", detected, seen["message"],
                       f"the unit {'new, whole' if written else 'old, untouched'} (atomic rename); no temporary "
                       f"file; the host let the lost run's lock go {held:.0f} s after the link was back", True)


def test_the_host_reboots_mid_deploy(clean_links):
    services.set_hub(size_mib=64)
    services.set_uplink(rate_mb_s=6)
    ssh("rtx01", f"rm -rf {CACHE}/hub")
    run = Run("--hosts", "rtx01")
    wait_for(downloading)
    killed = time.monotonic()
    machines.crash(RTX)  # the power goes: every process of the host killed at once
    rc, out, data = run.finish(300)
    detected = time.monotonic() - killed
    seen = failure(data)
    assert rc != 0 and seen["status"] in ("unreachable", "failed"), out[-2000:]
    services.set_uplink(rate_mb_s=0)
    invoke("lab.up", check=True)  # it boots again
    partial = int(ssh("rtx01", f"stat -c %s {BLOBS}/*.incomplete").stdout.split()[0])
    back = time.time()
    assert converges()
    assert leftovers() == ""
    resumed = [g for g in hub_gets(since=back) if g["range"]]
    assert resumed and resumed[0]["range"].startswith(f"bytes={partial}-"), hub_gets(since=back)
    reliability.record("fault-reboot", "fault", "the host reboots mid-deploy",
                       "rtx01's nspawn and all its processes killed (SIGKILL) during the weights download, booted "
                       "again", detected, seen["message"],
                       f"a partial blob of {partial // 1024 // 1024} MiB; the next deploy resumed it "
                       f"({resumed[0]['range']}) and converged", True)


@pytest.fixture(scope="class")
def rtx01_put_back(lab):
    """rtx01 as the lab's inventory has it, once the class's tests are done (each leaves it
    converged to a setting of its own, which the next one changes again)."""
    yield
    assert deploy_json("--hosts", "rtx01")[0].returncode == 0


class TestInterruptedAtAStepBoundary:
    # a setting that differs from the one before it (the lab's is 4): each run has a restart to make
    @pytest.mark.parametrize("sig,boundary,seqs", [
        (signal.SIGINT, "facts | gathered", 5), (signal.SIGINT, "image in force", 6),
        (signal.SIGINT, "rolling restart", 5), (signal.SIGTERM, "image | pull", 6),
        (signal.SIGTERM, "environment file", 5),
    ])
    def test_interrupted_at_a_step_boundary(self, clean_links, rtx01_put_back, lab_copy, sig, boundary, seqs):
        (lab_copy / "host_vars").mkdir(exist_ok=True)
        (lab_copy / "host_vars" / "rtx01.yml").write_text(f"max_num_seqs: {seqs}\n")
        run = Run("--hosts", "rtx01", inventory=lab_copy)
        run.until(boundary)
        sent = time.monotonic()
        run.proc.send_signal(sig)
        rc, out, data = run.finish(300)
        stopped = time.monotonic() - sent
        assert rc == (130 if sig == signal.SIGINT else 143), out[-2000:]
        assert "PLAY RECAP" in out and "interrupted by" in out
        assert data["interrupted"] == ("Ctrl-C" if sig == signal.SIGINT else "SIGTERM")
        left = leftovers()
        assert left == ""
        assert converges(lab_copy)
        assert f"--max-num-seqs {seqs}" in ssh("rtx01", f"cat {UNIT}").stdout
        name = "SIGINT (Ctrl-C)" if sig == signal.SIGINT else "SIGTERM"
        reliability.record(f"fault-signal-{sig.name}-{boundary.split()[0]}", "fault",
                           f"{name} to the control process after “{boundary}”",
                           "the signal, when that line is printed", stopped, next(line for line in out.splitlines() if "RECAP" in line).strip(),
                           "the recap; the host lock free; no temporary file", True)


def test_the_disk_under_the_model_cache_is_too_small_or_fills_during_the_download(clean_links, lab_copy):
    # a model the catalog does not know, so that preflight cannot size it: the download must
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text(
        "model: lab/tiny-test\nmin_free_disk_mib: 0\nmodel_cache: /run/small\n")
    # too small from the start: refused before a byte is fetched
    ssh("rtx01", "mkdir -p /run/small && mount -t tmpfs -o size=2m tmpfs /run/small")
    try:
        started = time.monotonic()
        proc, data = deploy_json("--hosts", "rtx01", "--set", "image_pull=missing", inventory=lab_copy)
        took = time.monotonic() - started
        seen = failure(data)
        assert proc.returncode == 1 and seen["role"] == "weights", proc.stdout[-2000:]
        assert "needs 4 MiB more" in seen["message"] and "nothing was fetched" in seen["message"]
    finally:
        ssh("rtx01", "umount /run/small")
    reliability.record("fault-disk-cache-small", "fault", "the disk under the model cache is too small",
                       "a 2 MiB filesystem as model_cache, a 4 MiB checkpoint the catalog does not size", took,
                       seen["message"], "nothing fetched, nothing written", True)
    # room at the start, filled by another program while the download runs
    services.set_uplink(rate_mb_s=1)
    ssh("rtx01", "mount -t tmpfs -o size=8m tmpfs /run/small")
    filler = subprocess.Popen(ssh_args("rtx01") + [
        "while ! ls /run/small/hub/*/blobs/*.incomplete >/dev/null 2>&1; do sleep 0.05; done; "
        "dd if=/dev/zero of=/run/small/filler bs=1M count=7 2>/dev/null; true"])
    try:
        started = time.monotonic()
        proc, data = deploy_json("--hosts", "rtx01", "--set", "image_pull=missing", inventory=lab_copy)
        took = time.monotonic() - started
        filler.wait(60)
        seen = failure(data)
        assert proc.returncode == 1 and seen["role"] == "weights", proc.stdout[-2000:]
        assert "the disk under /run/small is full (No space left on device)" in seen["message"]
        kept = ssh("rtx01", "du -k /run/small/hub | tail -n 1").stdout.split()[0]
        assert leftovers() == ""
    finally:
        filler.kill()
        ssh("rtx01", "umount /run/small; rmdir /run/small")
    assert converges()
    reliability.record("fault-disk-cache-full", "fault", "the disk under the model cache fills during the download",
                       "an 8 MiB model_cache, another program writing 7 MiB into it once the download starts "
                       "(1 MB/s)", took, seen["message"],
                       f"{kept} KiB downloaded and kept for a resume; the service's unit untouched (weights come "
                       f"before the unit)", True)


def test_the_disk_under_etc_fills_during_the_unit_write(clean_links, lab_copy, tmp_path):
    # /etc/dgemma and /etc/systemd/system on small filesystems, full
    for d, size in (("/etc/dgemma", "1m"), ("/etc/systemd/system", "8m")):
        ssh("rtx01", f"cp -a {d} /run/copy-{d.replace('/', '-')} && mount -t tmpfs -o size={size} tmpfs {d} && "
                     f"cp -a /run/copy-{d.replace('/', '-')}/. {d}/ && (dd if=/dev/zero of={d}/.filler bs=64k "
                     f"2>/dev/null; true)")
    before = ssh("rtx01", f"sha256sum {UNIT} {ENV}").stdout
    key = tmp_path / "key"
    key.write_text("another-key\n")
    key.chmod(0o600)
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text(f"max_num_seqs: 9\napi_key_file: {key}\n")
    try:
        started = time.monotonic()
        proc, data = deploy_json("--hosts", "rtx01", "--set", "image_pull=missing", inventory=lab_copy)
        took = time.monotonic() - started
        seen = failure(data)
        assert proc.returncode == 1 and "No space left on device" in seen["message"], proc.stdout[-2000:]
        assert "is full: free space there" in seen["message"]
        assert ssh("rtx01", f"sha256sum {UNIT} {ENV}").stdout == before  # both intact
        assert ssh("rtx01", "ls -A /etc/dgemma /etc/systemd/system | grep '^\\.' | grep -v filler || true"
                   ).stdout.strip() == ""
        ssh("rtx01", "rm -f /etc/dgemma/.filler /etc/systemd/system/.filler")
        assert converges(lab_copy)  # room again: it converges
    finally:
        ssh("rtx01", "for d in /etc/systemd/system /etc/dgemma; do umount $d; done; systemctl daemon-reload; "
                     "rm -rf /run/copy-*")
    assert converges()
    # what runs is what the files say again: vLLM and its front door, started on the small
    # filesystems with the other key, were restarted onto the lab's own
    lab_key = config.API_KEY_FILE.read_text().strip()
    status, body, _ = front_door("rtx01", "/v1/chat/completions", lab_key,
                                 {"model": "diffusiongemma", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
    assert status == 200, body[:300]
    reliability.record("fault-disk-etc", "fault", "the disk under /etc fills during the unit write",
                       "/etc/dgemma and /etc/systemd/system on full filesystems, a changed key and unit", took,
                       seen["message"], "the previous unit and env file, byte for byte", True)


def test_the_hub_stops_answering_mid_download_then_returns(clean_links):
    services.set_hub(size_mib=64)
    services.set_uplink(rate_mb_s=6)
    ssh("rtx01", f"rm -rf {CACHE}/hub")
    run = Run("--hosts", "rtx01", "--set", "download_stall_s=5")  # each of the 3 tries gives up after 5 s, not 20
    wait_for(downloading)
    stalled = time.monotonic()
    services.set_uplink(stalled=True)
    rc, out, data = run.finish(600)
    detected = time.monotonic() - stalled
    seen = failure(data)
    assert rc == 1 and seen["role"] == "weights" and "the next deploy resumes it" in seen["message"], out[-2000:]
    partial = int(ssh("rtx01", f"stat -c %s {BLOBS}/*.incomplete").stdout.split()[0])
    services.set_uplink(stalled=False, rate_mb_s=0)
    back = time.time()
    assert converges()
    gets = hub_gets(since=back)
    resumed = [g for g in gets if g["range"] and g["range"] != "bytes=0-"]
    assert resumed and sum(g["bytes"] for g in gets) < 64 * 1024 * 1024, gets
    reliability.record("fault-hub-stall", "fault", "the hub stops answering mid-download, then returns",
                       "the uplink stalled (no byte relayed, new connections unanswered) during a 64 MiB blob; "
                       "download_stall_s 5",
                       detected, seen["message"],
                       f"{partial // 1024 // 1024} MiB kept; the next deploy asked {resumed[0]['range']} and fetched "
                       f"{sum(g['bytes'] for g in gets) // 1024 // 1024} MiB, not 64", True)


def test_a_corrupt_blob_is_deleted_and_fetched_again(clean_links):
    services.set_hub(corrupt={"model.safetensors": 1})
    ssh("rtx01", f"rm -rf {CACHE}/hub")
    since = time.time()
    started = time.monotonic()
    proc, data = deploy_json("--hosts", "rtx01", "--set", "image_pull=missing")
    took = time.monotonic() - started
    weights = next(t for t in data["hosts"]["rtx01"]["tasks"] if t["task"].startswith("download"))
    assert proc.returncode == 0 and "failed their sha256 check" in weights["message"], proc.stdout[-2000:]
    assert len([g for g in hub_gets(since=since) if g["status"] in (200, 206)]) == 2
    reliability.record("fault-corrupt-blob", "fault", "a blob arrives with a wrong sha256",
                       "the hub flips one byte of model.safetensors once", took, weights["message"],
                       "the bad blob deleted, fetched again, verified", True)


def test_the_registry_stops_mid_pull_then_returns(clean_links):
    services.set_uplink(rate_mb_s=2)  # the image's 21 MB take about 10 s
    ssh("rtx01", "podman rmi -f 10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130 >/dev/null 2>&1; true")
    run = Run("--hosts", "rtx01")
    run.until("podman GPU access")
    time.sleep(3)  # the pull is under way
    stopped = time.monotonic()
    services.stop("registry")
    rc, out, data = run.finish(600)
    detected = time.monotonic() - stopped
    seen = failure(data)
    assert rc == 1 and seen["role"] == "image" and "Check the registry" in seen["message"], out[-2000:]
    services.ensure_registry()
    services.set_uplink(rate_mb_s=0)
    assert converges()
    reliability.record("fault-registry-stop", "fault", "the registry stops mid-pull, then returns",
                       "the registry killed 3 s into a pull at 2 MB/s, started again", detected, seen["message"],
                       "no image under the tag (podman keeps only whole images); the next deploy pulled it", True)


def test_nvidia_smi_hangs_then_recovers(clean_links):
    invoke("lab.gpu", "--host", "rtx01", "--hang", check=True)
    started = time.monotonic()
    proc, data = deploy_json("--hosts", "rtx01", "--set", "nvidia_smi_timeout=3")
    took = time.monotonic() - started
    invoke("lab.gpu", "--host", "rtx01", "--clear", check=True)
    seen = failure(data)
    assert proc.returncode == 1 and "wedged; reboot the host" in seen["message"]
    assert not any(t["status"] == "changed" for t in data["hosts"]["rtx01"]["tasks"])
    assert converges()
    reliability.record("fault-nvidia-smi-hang", "fault", "nvidia-smi hangs, then recovers",
                       "the GPU stand-in never answers (nvidia_smi_timeout 3 s)", took, seen["message"],
                       "nothing touched; the next deploy after it answered again converged", True)


def test_sshd_too_slow_to_answer(clean_links):
    try:
        # through the console, both ways: sshd itself is what is stopped
        machines.console(RTX, "systemctl kill -s STOP --kill-whom=main ssh.service", timeout=30)
        started = time.monotonic()
        proc, data = deploy_json("--hosts", "rtx01", "--set", "connect_timeout=3")
        took = time.monotonic() - started
    finally:
        # every sshd process on, then a fresh listener (sessions stay: KillMode=process),
        # so that nothing after this test meets a stopped sshd
        machines.console(RTX, "systemctl kill -s CONT ssh.service; systemctl restart ssh.service", timeout=60)
        machines.wait_ssh(RTX, timeout=60)
    seen = failure(data)
    assert proc.returncode == 1 and seen["status"] == "unreachable", proc.stdout[-2000:]
    assert "did not answer as an SSH server within 3 s" in seen["message"]
    assert converges()
    reliability.record("fault-sshd-slow", "fault", "sshd too slow to answer (no banner within connect_timeout)",
                       "rtx01's sshd stopped (SIGSTOP): connections are accepted, nothing answers", took,
                       seen["message"], "nothing touched", True)
