"""The image role's host programs (roles/image/files/*.sh) run for real under sh, with a
podman and a docker stand-in on a PATH of their own that log what they are asked: the pull
(through the relay, its fallback, none), the record written whole, the digest of the image's
own repository, and the result line the role reads."""
from __future__ import annotations

import os
import subprocess

import pytest

from serving.relay_probe import fallback_note
from roles.image.role import INSPECT, INSPECT_PROGRAM, PULL, pull_script

REF = "10.213.0.1:5000/vllm/vllm-openai:gemma-x86_64-cu130"
RELAYED = "10.213.0.1:7001/vllm/vllm-openai:gemma-x86_64-cu130"


def runtime(tmp_path, name: str, relay_fails: bool = False, pull_fails: bool = False,
            repo_digests: str = "", inspect_fails: bool = False) -> dict:
    """``name`` on a PATH of its own: it logs each call; pull prints a layer line."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    log = tmp_path / "calls"
    (bin_dir / name).write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$1 $2" in
  "pull --tls-verify=false") {'echo "Error: connection refused" >&2; exit 125' if relay_fails else 'echo "Copying blob sha256:0123456789ab done"'};;
  "pull "*) {'echo "Error: manifest unknown" >&2; exit 125' if pull_fails else 'echo "Copying blob sha256:0123456789ab done"'};;
  "image inspect")
    {'echo "Error: no such image" >&2; exit 125' if inspect_fails else ':'}
    case "$4" in
      "{{{{.Architecture}}}} {{{{.Digest}}}}") echo amd64 sha256:feed;;
      "{{{{.Architecture}}}}{{{{range .RepoDigests}}}} {{{{.}}}}{{{{end}}}}") echo 'amd64{repo_digests}';;
      *) echo "unexpected format: $4" >&2; exit 2;;
    esac;;
esac
exit 0
""")
    (bin_dir / name).chmod(0o755)
    return {"env": {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, "log": log}


def run(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=60, env=env)


def calls(rt: dict) -> list[str]:
    return rt["log"].read_text().splitlines() if rt["log"].exists() else []


def test_a_pull_through_the_relay_is_tagged_as_the_image_and_recorded(tmp_path):
    rt = runtime(tmp_path, "podman")
    record = tmp_path / "state" / "image"
    out = run(pull_script("podman", REF, str(record), relayed=RELAYED).replace(
        "STATE_DIR=/var/lib/dgemma", f"STATE_DIR={tmp_path / 'state'}"), rt["env"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert PULL.result_of(out.stdout) == {"digest": "sha256:feed", "arch": "amd64"}
    assert record.read_text() == f"{REF}\nsha256:feed\namd64\n"
    assert not [p for p in record.parent.iterdir() if p.name != "image"]  # no temporary file left
    assert calls(rt)[:3] == [f"pull --tls-verify=false {RELAYED}", f"tag {RELAYED} {REF}", f"untag {RELAYED} {RELAYED}"]
    assert "Copying blob" in out.stdout and fallback_note(out.stdout) == ""  # its lines stream to the display


def test_a_relay_that_fails_falls_back_to_the_registry_and_says_why(tmp_path):
    rt = runtime(tmp_path, "podman", relay_fails=True)
    out = run(pull_script("podman", REF, str(tmp_path / "image"), relayed=RELAYED).replace(
        "STATE_DIR=/var/lib/dgemma", f"STATE_DIR={tmp_path}"), rt["env"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert calls(rt)[:2] == [f"pull --tls-verify=false {RELAYED}", f"pull {REF}"]
    assert "connection refused" in fallback_note(out.stdout)
    assert PULL.result_of(out.stdout)["digest"] == "sha256:feed"


def test_a_failed_pull_records_nothing(tmp_path):
    rt = runtime(tmp_path, "podman", pull_fails=True)
    record = tmp_path / "image"
    out = run(pull_script("podman", REF, str(record)).replace("STATE_DIR=/var/lib/dgemma", f"STATE_DIR={tmp_path}"),
              rt["env"])
    assert out.returncode != 0 and not record.exists() and "@result" not in out.stdout
    assert calls(rt) == [f"pull {REF}"]


@pytest.mark.parametrize("name", ["podman", "docker"])
def test_an_image_the_runtime_cannot_inspect_is_not_recorded(tmp_path, name):
    rt = runtime(tmp_path, name, inspect_fails=True)
    record = tmp_path / "image"
    out = run(pull_script(name, REF, str(record), pull=False).replace(
        "STATE_DIR=/var/lib/dgemma", f"STATE_DIR={tmp_path}"), rt["env"])
    assert out.returncode != 0 and not record.exists() and "@result" not in out.stdout
    inspected = run(INSPECT_PROGRAM.script({"RUNTIME": name, "REF": REF}), rt["env"])
    assert inspected.returncode != 0 and "@result" not in inspected.stdout


@pytest.mark.parametrize("ref, digests, want", [
    # docker names Docker Hub's images without docker.io (and library/): the digest of the image's own repository
    ("vllm/vllm-openai:v0.33.0", " other/repo@sha256:0ther vllm/vllm-openai@sha256:cafe", "sha256:cafe"),
    ("docker.io/library/haproxy:2.6", " haproxy@sha256:beef", "sha256:beef"),
    (REF, f" {REF.rsplit(':', 1)[0]}@sha256:d00d", "sha256:d00d"),
    (REF, " elsewhere/vllm@sha256:0ther", ""),
    (REF, "", ""),  # built here, never pulled: no digest
])
def test_docker_keeps_the_digest_of_the_images_own_repository(tmp_path, ref, digests, want):
    rt = runtime(tmp_path, "docker", repo_digests=digests)
    record = tmp_path / "image"
    out = run(pull_script("docker", ref, str(record), pull=False).replace(
        "STATE_DIR=/var/lib/dgemma", f"STATE_DIR={tmp_path}"), rt["env"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert PULL.result_of(out.stdout) == {"digest": want, "arch": "amd64"}
    assert not [c for c in calls(rt) if c.startswith("pull")]  # PULL=0: the record alone
    assert len([c for c in calls(rt) if c.startswith("image inspect")]) == 1  # arch and digest, one CLI start
    assert record.read_text() == f"{ref}\n{want}\namd64\n"
    inspected = run(INSPECT_PROGRAM.script({"RUNTIME": "docker", "REF": ref}), rt["env"])
    assert INSPECT.result_of(inspected.stdout) == {"digest": want, "arch": "amd64"}  # what verify reads


def _docker_that_pulls(tmp_path, digest: str, moved: bool = False, fails: int = 0) -> dict:
    """A docker whose pull says what docker 24 says of a tag (unmoved or moved to ``digest``),
    or fails with ``fails``; its inspect answers as the image now here."""
    rt = runtime(tmp_path, "docker", repo_digests=f" {REF.rsplit(':', 1)[0]}@{digest}")
    pulled = ("echo 'Error response from daemon: manifest unknown' >&2; exit %d" % fails if fails else
              f"echo '{REF.rsplit(':', 1)[1]}: Pulling from vllm/vllm-openai'; echo 'Digest: {digest}'; "
              f"echo 'Status: {'Downloaded newer image' if moved else 'Image is up to date'} for {REF}'; echo '{REF}'")
    script = (tmp_path / "bin" / "docker").read_text().replace('  "pull "*)', f'  "pull {REF}") {pulled};;\n  "pull "*)', 1)
    (tmp_path / "bin" / "docker").write_text(script)
    return rt


@pytest.mark.parametrize("moved", [False, True])
def test_an_always_pull_that_finds_the_tag_unmoved_keeps_the_record_and_inspects_nothing(tmp_path, moved):
    """image_pull: always pulls at every deploy: where docker says the image is up to date at the
    digest recorded, that is the answer (no inspect, the record untouched); a tag that moved is
    inspected and recorded as before. The pull's lines pass through either way."""
    record = tmp_path / "image"
    record.write_text(f"{REF}\nsha256:0ld\namd64\n")
    rt = _docker_that_pulls(tmp_path, "sha256:0ld" if not moved else "sha256:n3w", moved=moved)
    out = run(pull_script("docker", REF, str(record), known=("sha256:0ld", "amd64")).replace(
        "STATE_DIR=/var/lib/dgemma", f"STATE_DIR={tmp_path}"), rt["env"])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "Pulling from vllm/vllm-openai" in out.stdout and "pull exit status" not in out.stdout
    inspects = [c for c in calls(rt) if c.startswith("image inspect")]
    if moved:
        assert PULL.result_of(out.stdout) == {"digest": "sha256:n3w", "arch": "amd64"} and len(inspects) == 1
        assert record.read_text() == f"{REF}\nsha256:n3w\namd64\n"
    else:
        assert PULL.result_of(out.stdout) == {"digest": "sha256:0ld", "arch": "amd64"} and inspects == []
        assert record.read_text() == f"{REF}\nsha256:0ld\namd64\n"
    assert [c for c in calls(rt) if c.startswith("pull")] == [f"pull {REF}"]


def test_an_always_pull_that_fails_exits_with_dockers_status_and_says_why(tmp_path):
    record = tmp_path / "image"
    record.write_text(f"{REF}\nsha256:0ld\namd64\n")
    rt = _docker_that_pulls(tmp_path, "sha256:0ld", fails=18)
    out = run(pull_script("docker", REF, str(record), known=("sha256:0ld", "amd64")).replace(
        "STATE_DIR=/var/lib/dgemma", f"STATE_DIR={tmp_path}"), rt["env"])
    assert out.returncode == 18 and "manifest unknown" in out.stdout, out.stdout + out.stderr
    assert "@result" not in out.stdout and record.read_text() == f"{REF}\nsha256:0ld\namd64\n"
