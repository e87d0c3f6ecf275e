"""The lab itself: real hosts reachable with host-key checking, arch, registry."""
import json

from tests.lab.conftest import ssh, invoke


def test_hosts_answer_ssh_with_strict_host_keys_and_spark_is_aarch64(lab):
    assert ssh("spark01", "uname -m").stdout.strip() == "aarch64"
    assert ssh("rtx01", "uname -m").stdout.strip() == "x86_64"
    assert ssh("h100-01", "systemctl is-system-running", check=False).stdout.strip() in ("running", "degraded")


def test_registry_pull_of_the_right_tag_on_each_host(lab):
    for host, tag, arch in (("spark01", "gemma-aarch64-cu130", "arm64"), ("h100-01", "gemma-x86_64-cu130", "amd64")):
        ref = f"10.213.0.1:5000/vllm/vllm-openai:{tag}"
        out = ssh(host, f"podman pull -q {ref} >/dev/null && podman image inspect --format '{{{{.Architecture}}}}' {ref}",
                  timeout=300).stdout.split()
        assert out[-1] == arch


def test_facts_on_the_lab_choose_the_tag_per_arch(lab, tmp_path):
    out = tmp_path / "facts.json"
    invoke("facts", "--json", out, check=True)
    hosts = json.loads(out.read_text())["hosts"]
    assert hosts["spark01"]["choice"]["image"].endswith("vllm/vllm-openai:gemma-aarch64-cu130")
    assert hosts["spark01"]["facts"]["gpus"][0]["memory_total_mib"] is None  # GB10: [N/A]
    assert hosts["spark01"]["choice"]["memory_source"].startswith("host MemTotal")
    for host in ("rtx01", "h100-01"):
        assert hosts[host]["choice"]["image"].endswith("vllm/vllm-openai:gemma-x86_64-cu130")
    assert hosts["rtx01"]["choice"]["model"] == "nvidia/diffusiongemma-26B-A4B-it-NVFP4"
    assert "NVFP4" not in hosts["h100-01"]["choice"]["model"]
    # the placement: one replica on the host's one GPU, by uuid, on vLLM's loopback port
    (replica,) = hosts["h100-01"]["choice"]["replicas"]
    assert replica["gpus"] == ["GPU-89e7186f-d78b-cbf2-c3eb-9b84c4828937"] and replica["tensor_parallel_size"] == 1
    assert replica["port"] == 8100 and replica["model"] == hosts["h100-01"]["choice"]["model"]
    assert hosts["h100-01"]["choice"]["skipped_gpus"] == []


def test_lab_status_lists_each_host(lab, tmp_path):
    out = tmp_path / "status.json"
    invoke("lab.status", "--json-out", out, check=True)
    rows = {r["host"]: r for r in json.loads(out.read_text())["hosts"]}
    assert rows["spark01"]["arch"] == "aarch64" and rows["spark01"]["state"] == "running"
    assert rows["rtx01"]["address"] == "10.213.0.12"


def test_image_presence_read_from_the_store_index_agrees_with_podman(lab):
    import roles
    from converge.transport.ssh import SSHTransport
    from converge.facts import Gathering, gather
    from converge.facts.containers import ImagePresent
    from converge.play import Play
    from tests.lab.conftest import LAB_INVENTORY

    present = "10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130"
    ssh("h100-01", f"podman pull -q {present} >/dev/null", timeout=300)
    refs = {"tagged": present, "other_tag": present.replace("cu130", "cu999"),
            "short": "vllm/vllm-openai:gemma-x86_64-cu130", "missing": "10.213.0.1:5000/nothing/here:1"}
    facts = {name: ImagePresent("podman", ref) for name, ref in refs.items()}
    settings = Play.load(str(LAB_INVENTORY), roles.schemas(), roles.defaults()).ssh_settings("h100-01")
    with SSHTransport(settings).open() as conn:  # through bastion01
        found = gather(conn, facts)
        raw = conn.run(Gathering({"tagged": facts["tagged"]}).script).stdout
    assert "@index 0" in raw  # read from the index, podman not started
    for name, ref in refs.items():
        podman_says = ssh("h100-01", f"podman image exists {ref}", check=False).returncode == 0
        assert found[name] is podman_says, name
    assert found["tagged"] and not found["other_tag"] and not found["missing"]


def test_scale_hosts_come_and_go_with_their_disks(lab):
    import subprocess

    from lab import config, machines
    from tests.lab.conftest import KEY, KNOWN

    node = config.hosts(1)[-1]  # node01
    try:
        invoke("lab.up", "--hosts", 1, check=True, timeout=600)
        out = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o",
                              f"UserKnownHostsFile={KNOWN}", "-i", str(KEY), f"root@{node.address}", "uname -m"],
                             capture_output=True, text=True, timeout=60)
        assert out.stdout.strip() == "x86_64", out.stderr
        with open("/proc/sys/fs/inotify/max_user_instances") as handle:
            assert int(handle.read()) >= 128 + 16 * 4
    finally:
        invoke("lab.up", check=True, timeout=600)  # the default lab: the extra host stopped, its disk gone
    assert not machines.running_pid(node) and not node.dir.exists()
    assert ssh("rtx01", "true").returncode == 0


def test_held_scripts_inline_or_too_long_for_a_command_line_both_run(lab):
    import socket

    from converge.hostlock import KEEP_HOLDING
    from converge.ssh_settings import SSHSettings
    from converge.transport import INLINE_MAX
    from converge.transport.ssh import SSHTransport
    from tests.lab.conftest import ADDRESS, KEY, KNOWN

    settings = SSHSettings("rtx01", ADDRESS["rtx01"], key_file=str(KEY), known_hosts=str(KNOWN))
    long_line = "x" * (INLINE_MAX + 10)
    with SSHTransport(settings).open() as conn:
        sock = conn.fabric.client.get_transport().sock
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)  # no delayed-ACK wait per command
        short = conn.hold("echo 'it''s inline'\n" + KEEP_HOLDING, timeout=10, inline=True)
        assert short.readline(10) == "its inline"
        long = conn.hold(f"echo {len(long_line)} ${{#v}}; v={long_line}; echo ${{#v}}\n" + KEEP_HOLDING, timeout=10,
                         inline=True)  # too long for a command line: sent on stdin instead
        assert long.readline(10).startswith(str(len(long_line)))
        assert long.readline(10) == str(len(long_line))
        assert conn.run("echo still here\n").stdout == "still here\n"
