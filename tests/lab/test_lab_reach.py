"""Reaching the lab's machines as the seeds' machines are reached: spark01 as a
user whose sudo asks a password, h100-01 through bastion01 on a network this
machine has no route to, rtx01 as root with a key."""
import json
import os
import pty
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time

import pytest
import yaml

from lab import config, machines
from tests.lab.conftest import ADDRESS, BASTION, KNOWN, ROOT, become_password, deploy_json, invoke, ssh


def test_h100_01_sits_behind_the_bastion(lab):
    with pytest.raises(OSError):
        socket.create_connection((ADDRESS["h100-01"], 22), timeout=3)
    assert ssh("h100-01", "hostname").stdout.strip() == "h100-01"  # through bastion01
    # the bastion is sshd and nothing else, and takes no root login
    bastion = ssh("rtx01", f"timeout 5 bash -c 'exec 3<>/dev/tcp/{BASTION.address}/22; head -c 4 <&3'")
    assert bastion.stdout == "SSH-"
    root_login = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={KNOWN}", "-i",
                                 str(config.STATE / "ssh/id_ed25519"), f"root@{BASTION.address}", "true"],
                                capture_output=True, text=True, timeout=30)
    assert root_login.returncode == 255 and "Permission denied" in root_login.stderr


def test_spark01_is_a_user_with_sudo_that_asks_a_password(lab):
    assert (config.STATE / "secrets" / "spark01-become").stat().st_mode & 0o777 == 0o600
    login = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={KNOWN}", "-i",
                            str(config.STATE / "ssh/id_ed25519"), f"nvidia@{ADDRESS['spark01']}",
                            "id -un; sudo -n true"], capture_output=True, text=True, timeout=60)
    assert login.stdout.split()[0] == "nvidia" and "a password is required" in login.stderr
    assert ssh("spark01", "id -u").stdout.strip() == "0"  # with the password on sudo's stdin
    # sudo checks it against a yescrypt hash, as on DGX OS, at the lowest cost (lab.rootfs says why)
    assert ssh("spark01", "getent shadow nvidia | cut -d: -f2").stdout.startswith("$y$j75$")


# the kernel's process events (the proc connector, over netlink): linux/connector.h, linux/cn_proc.h
NETLINK_CONNECTOR, CN_IDX_PROC, CN_VAL_PROC, PROC_CN_MCAST_LISTEN, PROC_EVENT_EXEC = 11, 1, 1, 1, 2
NLMSG_DONE = 3
EVENT_AT = 16 + 20  # a netlink header, then a connector header, then the event
FULL_SCAN_EVERY_S = 0.5


def _exec_events():
    """A socket that gets the pid of each program started on this machine, the lab hosts'
    included, as it starts; None where the kernel gives none (then every process is read
    again every 10 ms, which costs most of a core)."""
    try:
        events = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_CONNECTOR)
        events.bind((0, CN_IDX_PROC))
        events.setsockopt(socket.SOL_SOCKET, 33, 16 << 20)  # SO_RCVBUFFORCE (root): a burst of starts fits
        listen = struct.pack("I", PROC_CN_MCAST_LISTEN)
        message = struct.pack("IIIIHH", CN_IDX_PROC, CN_VAL_PROC, 0, 0, len(listen), 0) + listen
        events.send(struct.pack("IHHII", 16 + len(message), NLMSG_DONE, 0, 0, 0) + message)
        events.settimeout(0.1)
        return events
    except OSError:
        return None


def _scanner(secret: bytes, found: list, stop: threading.Event):
    """Every process's argv and environment, on this machine and on the lab hosts
    (their processes are this machine's too): each program's as it starts (the kernel
    says when), and every process's again twice a second (one that rewrites its argv);
    with no word from the kernel, every process's every 10 ms."""
    def read(pid):
        for part in ("cmdline", "environ"):
            try:
                with open(f"/proc/{pid}/{part}", "rb") as handle:
                    if secret in handle.read():
                        found.append((pid, part))
            except OSError:
                continue

    def read_all():
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                read(pid)

    events, scanned = _exec_events(), 0.0
    try:
        while not stop.is_set():
            if events is None:
                read_all()
                time.sleep(0.01)
                continue
            if time.monotonic() - scanned >= FULL_SCAN_EVERY_S:
                read_all()
                scanned = time.monotonic()
            try:
                event = events.recv(256)
            except socket.timeout:
                continue
            except OSError:  # ENOBUFS: starts were missed while this thread was behind
                scanned = 0.0
                continue
            # a message too short for an exec event is no exec: unpacking it would end this
            # thread, and a dead scanner finds nothing, which would pass the test
            if len(event) < EVENT_AT + 24:
                continue
            what, = struct.unpack_from("I", event, EVENT_AT)
            if what == PROC_EVENT_EXEC:
                read(struct.unpack_from("I", event, EVENT_AT + 20)[0])  # its tgid
    except Exception as exc:  # a scanner that stopped finds nothing: the test must fail, saying why
        found.append(("the scanner stopped", repr(exc)))
    finally:
        if events is not None:
            events.close()


def _spark01_journal() -> str:
    return machines.console(config.host("spark01"), "journalctl --no-pager -o cat -n 20000").stdout


SPARK_UNIT = "/etc/systemd/system/docker-vllm-diffusiongemma.service"


@pytest.fixture(scope="module", autouse=True)
def spark01_back_to_the_labs_values(lab):
    """The first test leaves spark01 changed (max_num_seqs 5) for the next to put back through a
    typed become password (a deploy that writes and restarts there too); where that one did not
    run or stopped early, this does it."""
    yield
    if "--max-num-seqs 5" in ssh("spark01", f"cat {SPARK_UNIT}", check=False).stdout:
        assert deploy_json("--hosts", "spark01")[0].returncode == 0


def test_the_become_password_appears_nowhere_but_sudos_stdin(lab, lab_copy, tmp_path):
    password = become_password("spark01")
    # a change on spark01, so the deploy writes files, restarts and waits through sudo
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "spark01.yml").write_text("max_num_seqs: 5\n")
    found, stop = [], threading.Event()
    scanner = threading.Thread(target=_scanner, args=(password.encode(), found, stop), daemon=True)
    scanner.start()
    try:
        proc, data = deploy_json("--hosts", "spark01", inventory=lab_copy)
        verified = invoke("verify", "--hosts", "spark01", inventory=lab_copy)
    finally:
        stop.set()
        scanner.join(5)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert verified.returncode == 0, verified.stdout[-3000:]
    assert data["hosts"]["spark01"]["recap"]["changed"] > 0
    assert "--max-num-seqs 5" in ssh("spark01", f"cat {SPARK_UNIT}").stdout
    assert found == []
    for text in (proc.stdout, proc.stderr, json.dumps(data), verified.stdout, verified.stderr, _spark01_journal()):
        assert password not in text
    # spark01 stays changed: the next test's deploy, through a typed password, puts the lab's values back


def test_ask_become_pass_on_a_terminal_once_for_every_host(lab, lab_copy):
    password = become_password("spark01")
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    del hosts["all"]["children"]["spark"]["hosts"]["spark01"]["become_password_file"]
    # rtx01 becomes too, with the same typed password (root's sudo does not ask: it is skipped unread)
    hosts["all"]["children"]["rtx"]["hosts"]["rtx01"]["ansible_become"] = True
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    found, stop = [], threading.Event()
    scanner = threading.Thread(target=_scanner, args=(password.encode(), found, stop), daemon=True)
    scanner.start()
    pid, fd = pty.fork()
    if pid == 0:
        os.chdir(ROOT)
        os.environ.update(DGEMMA_INVENTORY=str(lab_copy), COLUMNS="200")
        os.execv(sys.executable, [sys.executable, "-m", "invoke", "deploy", "-K", "--hosts", "spark01,rtx01",
                                  "--set", "image_pull=missing"])
    output, prompts = b"", 0
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 1)
            if not ready:
                continue
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            output += chunk
            if output.count(b"BECOME password: ") > prompts:
                prompts += 1
                os.write(fd, password.encode() + b"\n")
        _, status = os.waitpid(pid, 0)
    finally:
        stop.set()
        scanner.join(5)
    text = re.sub(r"\x1b\[[0-9;]*m", "", output.decode(errors="replace"))  # a terminal gets colours
    assert os.waitstatus_to_exitcode(status) == 0, text[-3000:]
    assert prompts == 1  # asked once, for both hosts
    assert password not in text  # not echoed
    assert re.search(r"spark01 +: ok=\d+ +changed=\d+ +unreachable=0 +failed=0", text)
    assert found == []
    assert password not in _spark01_journal()
    # what the test before left changed, put back through sudo with the typed password
    assert "--max-num-seqs 5" not in ssh("spark01", f"cat {SPARK_UNIT}").stdout


def test_a_wrong_become_password_fails_that_host_alone_within_seconds(lab, lab_copy, tmp_path):
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password\n")
    wrong.chmod(0o600)
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    hosts["all"]["children"]["spark"]["hosts"]["spark01"]["become_password_file"] = str(wrong)
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    started = time.monotonic()
    proc, data = deploy_json("--hosts", "spark01,rtx01", "--set", "image_pull=missing", inventory=lab_copy)
    failed = [t for t in data["hosts"]["spark01"]["tasks"] if t["status"] == "failed"]
    assert failed and failed[0]["message"].startswith("sudo refused the password for nvidia on spark01")
    assert failed[0]["seconds"] < 10
    assert data["hosts"]["rtx01"]["recap"]["failed"] == 0 and proc.returncode == 1
    print(f"wrong password: spark01 failed after {failed[0]['seconds']:.1f} s; the run took "
          f"{time.monotonic() - started:.1f} s")
    # a password file others may read is refused before anything is tried
    wrong.chmod(0o644)
    proc, data = deploy_json("--hosts", "spark01", inventory=lab_copy)
    assert "is mode 0644" in data["hosts"]["spark01"]["tasks"][0]["message"]


def test_passwordless_sudo_keeps_working(lab, lab_copy):
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    hosts["all"]["children"]["rtx"]["hosts"]["rtx01"]["ansible_become"] = True  # root: sudo -n asks nothing
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    proc, data = deploy_json("--hosts", "rtx01", "--set", "image_pull=missing", inventory=lab_copy)
    assert proc.returncode == 0 and data["hosts"]["rtx01"]["recap"]["changed"] == 0, proc.stdout[-2000:]


def test_trust_pins_the_bastion_and_the_host_behind_it(lab, lab_copy, tmp_path):
    known = tmp_path / "known_hosts"
    known.write_text("")
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    hosts["all"]["vars"]["known_hosts_file"] = str(known)
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    proc, data = deploy_json("--hosts", "h100-01", inventory=lab_copy)
    message = data["hosts"]["h100-01"]["tasks"][0]["message"]
    assert "the jump host jump@10.213.0.10" in message and "not in known_hosts" in message
    assert "invoke trust --hosts h100-01" in message
    proc = invoke("trust", "--hosts", "h100-01", "--yes", inventory=lab_copy)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"jump host jump@{BASTION.address}" in proc.stdout and "10.213.1.13" in proc.stdout
    pinned = known.read_text()
    assert BASTION.address in pinned and ADDRESS["h100-01"] in pinned
    proc, data = deploy_json("--hosts", "h100-01", "--set", "image_pull=missing", inventory=lab_copy)
    assert proc.returncode == 0, proc.stdout[-2000:]
    # a changed key of the bastion is refused like any other
    bastion_line = next(line for line in pinned.splitlines() if line.startswith(BASTION.address))
    rtx_key = (config.STATE / "hosts/rtx01/root/etc/ssh/ssh_host_ed25519_key.pub").read_text().split()
    known.write_text(pinned.replace(bastion_line, f"{BASTION.address} {rtx_key[0]} {rtx_key[1]}"))
    proc, data = deploy_json("--hosts", "h100-01", inventory=lab_copy)
    message = data["hosts"]["h100-01"]["tasks"][0]["message"]
    assert "the jump host" in message and "CHANGED" in message


def test_hosts_behind_one_bastion_share_one_connection_to_it(lab, lab_copy):
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    # rtx01 through the bastion too (it reaches the lab network)
    hosts["all"]["children"]["rtx"]["hosts"]["rtx01"]["ansible_ssh_common_args"] = \
        f"-o ProxyJump={BASTION.login}@{BASTION.address}"
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))

    def accepted():
        log = machines.console(BASTION, "journalctl --no-pager -o cat _COMM=sshd").stdout
        return log.count(f"Accepted publickey for {BASTION.login}")

    before = accepted()
    proc, data = deploy_json("--hosts", "rtx01,h100-01", "--set", "image_pull=missing", inventory=lab_copy)
    assert proc.returncode == 0, proc.stdout[-2000:]
    time.sleep(1)
    assert accepted() - before == 1
