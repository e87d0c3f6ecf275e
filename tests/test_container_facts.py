"""The image-presence fact: which way it asks, and what each answer means.
(tests/lab/test_lab_hosts.py checks it agrees with `podman image exists` on a real host.)"""
import pytest

from converge.facts import FactError
from converge.facts.containers import ImagePresent

QUALIFIED = "10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130"


@pytest.mark.parametrize("runtime, ref, reads_index", [
    ("podman", QUALIFIED, True),
    ("podman", "quay.io/org/image:1.0", True),
    ("podman", "localhost/image:dev", True),
    ("podman", "vllm/vllm-openai:gemma-x86_64-cu130", False),  # short name: registries.conf decides
    ("podman", "docker.io/vllm/vllm-openai:latest", False),    # docker.io renames (library/)
    ("podman", "quay.io/org/image@sha256:" + "0" * 64, False),  # by digest: not a name in the index
    ("podman", "quay.io/org/image", False),                     # no tag
    ("docker", QUALIFIED, False),                               # docker has a daemon to ask
])
def test_the_store_index_is_read_only_where_it_names_the_image_as_the_runtime_would(runtime, ref, reads_index):
    command = ImagePresent(runtime, ref).command
    assert command.startswith("fact_image_indexed " if reads_index else f"fact_image_asked {runtime} ")


@pytest.mark.parametrize("output, present", [
    ("@index 0", True), ("@index 1", False), ("@index 2", False),  # 2: no images.json yet, an empty store
    ("@rc 0", True), ("@rc 1", False),
])
def test_answers(output, present):
    assert ImagePresent("podman", QUALIFIED).process(output + "\n", 0) is present


@pytest.mark.parametrize("output", ["@rc 125", "@rc 127", "sh: 1: sed: not found", ""])
def test_a_runtime_that_cannot_answer_is_an_error_not_an_absent_image(output):
    with pytest.raises(FactError):
        ImagePresent("podman", QUALIFIED).process(output, 0)


def test_runtimes_and_what_keeps_docker_from_the_gpu():
    from converge.facts.containers import parse_runtimes
    from roles.preflight.role import runtime_problem
    ready = parse_runtimes('@docker Docker version 20.10.24+dfsg1, build 297e128\n'
                           '@docker-runtimes {"io.containerd.runc.v2":{},"nvidia":{"path":"nvidia-container-runtime"},'
                           '"runc":{}}\n@nvidia-hook /usr/bin/nvidia-container-runtime-hook\n')
    assert ready["docker"] == {"version": "20.10.24", "runtimes": ["io.containerd.runc.v2", "nvidia", "runc"],
                               "daemon": True, "nvidia_hook": True}
    assert runtime_problem("docker", ready) is None
    no_runtime = parse_runtimes('@docker Docker version 24.0.7\n@docker-runtimes {"runc":{}}\n@nvidia-hook -\n')
    assert "nvidia-ctk runtime configure --runtime=docker" in runtime_problem("docker", no_runtime)
    no_hook = parse_runtimes('@docker Docker version 24.0.7\n@docker-runtimes {"nvidia":{},"runc":{}}\n'
                             '@nvidia-hook -\n')
    assert "nvidia-container-runtime-hook" in runtime_problem("docker", no_hook)
    down = parse_runtimes("@docker Docker version 24.0.7\n@docker-runtimes unreachable\n@nvidia-hook -\n")
    assert runtime_problem("docker", down) == "the docker daemon does not answer: systemctl start docker"
    assert "CDI spec" in runtime_problem("podman", parse_runtimes("@podman podman version 4.3.1\n"))


@pytest.mark.parametrize("daemon_answers", [True, False])
def test_the_runtimes_fact_starts_docker_once_where_its_daemon_answers(tmp_path, daemon_answers):
    """fact_runtimes run for real with a docker stand-in (20.10's answers) that logs each call:
    its daemon's version and runtimes from one `docker info`; where the daemon does not answer,
    `docker --version` for the client's, and the daemon called unreachable."""
    import os
    import subprocess
    from converge.facts.containers import Runtimes
    bin_dir, log = tmp_path / "bin", tmp_path / "calls"
    bin_dir.mkdir()
    info = ("echo '20.10.24+dfsg1 {\"nvidia\":{\"path\":\"nvidia-container-runtime\"},\"runc\":{}}'"
            if daemon_answers else "echo 'Cannot connect to the Docker daemon' >&2; exit 1")
    (bin_dir / "docker").write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$1" in
  info) {info};;
  --version) echo 'Docker version 20.10.24+dfsg1, build 297e128';;
esac
""")
    (bin_dir / "docker").chmod(0o755)
    fact = Runtimes()
    out = subprocess.run(["sh", "-s"], input=fact.standalone(), capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"})
    docker = fact.process(out.stdout, out.returncode)["docker"]
    calls = log.read_text().splitlines()
    if daemon_answers:
        assert docker == {"version": "20.10.24", "runtimes": ["nvidia", "runc"], "daemon": True, "nvidia_hook": False}
        assert calls == ["info --format {{.ServerVersion}} {{json .Runtimes}}"]
    else:
        assert docker == {"version": "20.10.24", "runtimes": [], "daemon": False, "nvidia_hook": False}
        assert calls == ["info --format {{.ServerVersion}} {{json .Runtimes}}", "--version"]


def test_unit_files_of_a_family_read_from_a_real_capture():
    """Replicas 1-3 of hgx01, as the UnitFiles fact printed them there (systemd 252)."""
    from converge.facts.host import UnitFiles
    from tests.conftest import ROOT
    fact = UnitFiles("/etc/systemd/system/podman-vllm-diffusiongemma-[0-9]*.service")
    found = fact.process((ROOT / "tests/fixtures/systemd/unit-files-hgx01.txt").read_text(), 0)
    assert sorted(found) == [f"/etc/systemd/system/podman-vllm-diffusiongemma-{i}.service" for i in (1, 2, 3)]
    second = found["/etc/systemd/system/podman-vllm-diffusiongemma-2.service"]
    assert second["file"]["mode"] == "0644" and second["file"]["owner"] == "root"
    assert "--port 8102" in second["file"]["content"] and len(second["file"]["sha256"]) == 64
    assert (second["state"]["LoadState"], second["state"]["ActiveState"], second["state"]["UnitFileState"]) == \
        ("loaded", "active", "enabled")
    assert fact.process("", 0) == {}
    with pytest.raises(ValueError):
        UnitFiles("/etc/x-*.service; rm -rf /")


def test_the_store_index_is_read_on_the_host_and_podman_asked_when_storage_conf_moves_the_store(tmp_path):
    """fact_image_indexed (converge/facts/files/containers.sh) run for real: the index of a store laid out
    for the test, storage.conf saying its defaults; then storage.conf naming another graphroot, where
    podman (a stand-in that says it has the image) is asked instead."""
    import os
    import subprocess
    from converge.facts.containers import PODMAN_STORE
    index = tmp_path / "overlay-images"
    index.mkdir()
    (index / "images.lock").write_text("")
    (index / "images.json").write_text('[{"id": "a", "names": ["%s"]}]' % QUALIFIED)
    conf = tmp_path / "storage.conf"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "podman").write_text("#!/bin/sh\n[ \"$1 $2\" = 'image exists' ]\n")
    (bin_dir / "podman").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CONTAINERS_STORAGE_CONF": str(conf)}

    def present(ref: str) -> bool:
        fact = ImagePresent("podman", ref)
        script = fact.standalone().replace(f"{PODMAN_STORE}/overlay-images", str(index))
        out = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, env=env, timeout=30).stdout
        present.said = out.strip()
        return fact.process(out, 0)

    conf.write_text('[storage]\ndriver = "overlay"\ngraphroot = "/var/lib/containers/storage"\n')
    assert present(QUALIFIED) and present.said == "@index 0"
    assert not present("registry.lab:5000/a/b:c") and present.said == "@index 1"
    conf.write_text('[storage]\ndriver = "overlay"\ngraphroot = "/srv/containers"\n')
    assert present(QUALIFIED) and present.said == "@rc 0", "storage.conf moved the store: podman is asked"
