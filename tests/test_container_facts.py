"""The image-presence fact: which way it asks, and what each answer means.
(tests/lab/test_lab_hosts.py checks it agrees with `podman image exists` on a real host.)"""
import json
import os
import socketserver
import subprocess
import threading
from http.server import BaseHTTPRequestHandler

import pytest

from converge.facts import FactError
from converge.facts.containers import DOCKER_SOCKET, ImagePresent, Images, Runtimes
from tests.conftest import ROOT

DOCKER_API = ROOT / "tests/fixtures/docker-api"

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
    # no Engine API socket: the CLI is asked (test_docker_is_asked_through_its_engine_api_where_the_cli_would_be)
    script = fact.standalone().replace(DOCKER_SOCKET, str(tmp_path / "no-docker.sock"))
    out = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=60,
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


@pytest.mark.parametrize("fact", ["runtimes", "images"])
def test_the_engine_apis_answers_read_as_the_clis_do(fact):
    """Real captures of one host (the lab's spark01, docker 20.10.24 on arm64) through each way of
    asking: the Engine API on its socket (what the facts ask where they can), then docker's CLI."""
    parse = (Runtimes() if fact == "runtimes" else Images("docker")).process
    api, cli = ((DOCKER_API / f"{fact}-spark01-{way}.txt").read_text() for way in ("api", "cli"))
    assert api.split("\n", 2)[fact == "runtimes"].startswith("@docker-api")
    assert parse(api, 0) == parse(cli, 0)
    if fact == "images":
        assert {i["arch"] for i in parse(api, 0)} == {"arm64"} and len(parse(api, 0)) == 3
    else:
        assert parse(api, 0)["docker"] == {"version": "20.10.24", "daemon": True, "nvidia_hook": True,
                                           "runtimes": ["io.containerd.runc.v2", "io.containerd.runtime.v1.linux",
                                                        "nvidia", "runc", "runcx86"]}


class _EngineApi(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


def _engine_api(path, documents: dict[str, str]):
    """An HTTP server on the unix socket ``path`` answering GET path -> document (404 otherwise)."""
    class Answer(BaseHTTPRequestHandler):
        def do_GET(self):
            body = documents.get(self.path)
            self.send_response(200 if body is not None else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write((body or '{"message":"No such image"}').encode() + b"\n")

        def address_string(self):
            return "engine-api"

        def log_message(self, *args):
            pass
    server = _EngineApi(str(path), Answer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


@pytest.mark.parametrize("elsewhere", [None, "DOCKER_HOST", "DOCKER_CONTEXT", "currentContext"])
def test_docker_is_asked_through_its_engine_api_where_the_cli_would_be(tmp_path, elsewhere):
    """fact_runtimes and fact_images run for real beside an Engine API on a socket (the captures'
    answers) and a docker CLI stand-in that logs its calls: with nothing pointing docker elsewhere,
    curl asks the socket and the CLI is not started; with DOCKER_HOST, DOCKER_CONTEXT or a context
    chosen in its config, the CLI is asked, as before. Either way the facts say the same. An image
    removed between the list and its document is left out."""
    captured = [json.loads(line) for line in (DOCKER_API / "images-spark01-api.txt").read_text().splitlines()[1:]]
    info = (DOCKER_API / "runtimes-spark01-api.txt").read_text().split("@docker-api ", 1)[1].split("\n", 1)[0]
    gone = "sha256:" + "e" * 64
    documents = {"/info": info, "/images/json": json.dumps([{"Id": d["Id"], "ParentId": gone} for d in captured]
                                                           + [{"Id": gone, "RepoTags": ["x:1"]}])}
    documents.update({f"/images/{d['Id']}/json": json.dumps(d) for d in captured})
    sock = tmp_path / "docker.sock"
    server = _engine_api(sock, documents)
    bin_dir, log, home = tmp_path / "bin", tmp_path / "calls", tmp_path / "home"
    bin_dir.mkdir()
    (home / ".docker").mkdir(parents=True)
    cli = {"info": f"echo '20.10.24+dfsg1 {json.dumps(json.loads(info)['Runtimes'], separators=(',', ':'))}'",
           "images": "echo " + " ".join(d["Id"] for d in captured),
           "image": "\n".join(f"echo '{d['Id']}\t{d['Architecture']}\t{json.dumps(d['RepoTags'])}\t"
                              f"{json.dumps(d['RepoDigests'])}'" for d in captured)}
    (bin_dir / "docker").write_text(f"#!/bin/sh\necho \"$1\" >> {log}\ncase \"$1\" in\n"
                                    + "".join(f"  {word}) {answer};;\n" for word, answer in cli.items()) + "esac\n")
    (bin_dir / "docker").chmod(0o755)
    (bin_dir / "nvidia-container-runtime-hook").write_text("#!/bin/sh\n")
    (bin_dir / "nvidia-container-runtime-hook").chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(home)}
    if elsewhere == "currentContext":
        (home / ".docker" / "config.json").write_text('{"auths": {}, "currentContext": "remote"}')
    elif elsewhere:
        env[elsewhere] = "tcp://elsewhere:2375" if elsewhere == "DOCKER_HOST" else "remote"
    try:
        found = {}
        for name, fact in (("runtimes", Runtimes()), ("images", Images("docker"))):
            out = subprocess.run(["sh", "-s"], input=fact.standalone().replace(DOCKER_SOCKET, str(sock)),
                                 capture_output=True, text=True, timeout=60, env=env)
            found[name] = fact.process(out.stdout, out.returncode)
    finally:
        server.shutdown()
        server.server_close()
    calls = log.read_text().split() if log.exists() else []
    assert calls == ([] if elsewhere is None else ["info", "images", "image"])
    assert found["runtimes"]["docker"] == {"version": "20.10.24", "daemon": True, "nvidia_hook": True,
                                           "runtimes": ["io.containerd.runc.v2", "io.containerd.runtime.v1.linux",
                                                        "nvidia", "runc", "runcx86"]}
    assert [(i["id"], i["arch"], i["tags"]) for i in found["images"]] == \
        [(d["Id"], "arm64", d["RepoTags"]) for d in sorted(captured, key=lambda d: d["Id"])]
