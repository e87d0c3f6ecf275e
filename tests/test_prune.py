"""Prune and the release history: the pure selection on facts captured on the lab (podman's
`system df -v` on rtx01, the Engine API's /system/df on spark01), and the host programs run
for real under sh on a Hugging Face cache laid out in a temporary folder."""
from __future__ import annotations

import base64
import json
import os
import subprocess
from pathlib import Path

import pytest

from serving import prune
from roles.start.role import RECORD, RECORD_PROGRAM
from serving.releases import kept, parse_history, rollback_target

DATA = Path(__file__).parent / "data" / "disk"
REPO = "10.213.0.1:5000/vllm/vllm-openai"
MODEL = "nvidia/diffusiongemma-26B-A4B-it-NVFP4"
UNIT = "vllm-diffusiongemma.service"


def line(image, digest, commit="c" * 40, at="2026-12-01T00:00:00Z", unit=UNIT, model=MODEL):
    return json.dumps({"unit": unit, "image": image, "digest": digest, "model": model, "revision": "main",
                       "commit": commit, "at": at})


def image(ident, tags, digests=(), arch="amd64"):
    repo_digests = [f"{REPO}@{d}" for d in digests]
    return {"id": ident, "arch": arch, "tags": list(tags), "repo_digests": repo_digests, "digests": sorted(digests)}


HISTORY = "\n".join([line(f"{REPO}:r1", "sha256:1"), line(f"{REPO}:r2", "sha256:2"), line(f"{REPO}:r3", "sha256:3"),
                     "not json"])


def test_the_history_names_each_units_rollback_target_and_the_releases_kept():
    releases = parse_history(HISTORY)
    assert [r.image for r in releases] == [f"{REPO}:r1", f"{REPO}:r2", f"{REPO}:r3"]  # the bad line left out
    assert rollback_target(releases, UNIT).image == f"{REPO}:r2"
    assert rollback_target(releases, "other.service") is None
    assert [r.image for r in kept(releases, 1)] == [f"{REPO}:r3", f"{REPO}:r2"]
    assert [r.image for r in kept(releases, 0)] == [f"{REPO}:r3"]
    assert [r.image for r in kept(releases, 5)] == [f"{REPO}:r3", f"{REPO}:r2", f"{REPO}:r1"]
    # a release deployed again is one release: r2 -> r3 -> r2 keeps r3 as the target
    again = parse_history(HISTORY + "\n" + line(f"{REPO}:r2", "sha256:2"))
    assert rollback_target(again, UNIT).image == f"{REPO}:r3"
    assert [r.image for r in kept(again, 1)] == [f"{REPO}:r2", f"{REPO}:r3"]


def test_podman_and_docker_space_as_the_lab_printed_it():
    podman = prune.parse_prune_facts("@podman-df\n" + (DATA / "podman-system-df.txt").read_text())["space"]
    assert podman["d9dffc7892fb"] == {"size": 58230000, "unique": 0, "containers": 0}
    assert podman["bdae7e8d6cc7"] == {"size": 60330000, "unique": 60330000, "containers": 1}  # "59 seconds" old
    assert podman["9d7fbb369d9f"]["unique"] == 792 and podman["9d7fbb369d9f"]["containers"] == 0
    assert podman["4888f3f6b8f2"] == {"size": 19600000, "unique": 19600000, "containers": 1}
    docker = prune.parse_prune_facts("@docker-df " + (DATA / "docker-system-df.json").read_text().replace("\n", ""))
    assert docker["space"] and all(set(v) == {"size", "unique", "containers"} for v in docker["space"].values())
    assert prune.human_bytes("58.23MB") == 58230000 and prune.human_bytes("796B") == 796
    assert prune.human_bytes("1.2GB") == 1200000000 and prune.human_bytes("n/a") is None


def select(images, space, models=None, keep=1, history=HISTORY, wanted=(f"{REPO}:gemma",)):
    return prune.select(parse_history(history), images, space, models or {}, keep, {"vllm/vllm-openai"},
                        set(wanted), "/srv/models/hf-cache")


def test_images_no_container_uses_and_no_kept_release_names_are_removed_and_nothing_else():
    images = [image("sha256:a1", [f"{REPO}:r1"], ["sha256:1"]), image("sha256:a2", [f"{REPO}:r2"], ["sha256:2"]),
              image("sha256:a3", [f"{REPO}:r3"], ["sha256:3"]), image("sha256:g", [f"{REPO}:gemma"], ["sha256:g"]),
              image("sha256:f", ["docker.io/library/busybox:1"], ["sha256:f"]),
              image("sha256:m", [f"{REPO}:r0", "docker.io/someone/else:1"], ["sha256:m"]),
              image("sha256:o", [], ["sha256:0"]),  # r0's image after its tag moved: dangling, its digest ours
              image("sha256:x", [])]
    space = {"a1": {"size": 5, "unique": 2, "containers": 0}, "a3": {"size": 5, "unique": 1, "containers": 1},
             "o": {"size": 7, "unique": 7, "containers": 0}}
    chosen = select(images, space)
    assert [(r.kind, r.what, r.size, r.frees) for r in chosen.remove] == [
        ("image", f"{REPO}:r1", 5, 2), ("image", f"{REPO}@sha256:0", 7, 7)]
    assert chosen.remove[0].params == {"ID": "sha256:a1", "TAGS": f"{REPO}:r1"}
    assert chosen.remove[1].params == {"ID": "sha256:o", "TAGS": ""}
    why = dict(chosen.keep)
    assert why[f"{REPO}:r3"] == "a container uses it" and why[f"{REPO}:r2"] == "a kept release"
    assert why[f"{REPO}:gemma"].startswith("a replica's current image")
    assert why[f"{REPO}:r0"] == "also tagged for someone/else"
    assert "docker.io/library/busybox:1" not in why
    # keep 0: the rollback target goes too; keep 2: r1 stays
    assert [r.what for r in select(images, space, keep=0).remove] == [f"{REPO}:r1", f"{REPO}:r2", f"{REPO}@sha256:0"]
    assert [r.what for r in select(images, space, keep=2).remove] == [f"{REPO}@sha256:0"]


def test_old_snapshots_go_with_the_blobs_only_they_link_and_other_models_are_never_read():
    old, new = "a" * 40, "b" * 40
    history = "\n".join([line(f"{REPO}:r1", "sha256:1", commit=old), line(f"{REPO}:r2", "sha256:2", commit=old),
                         line(f"{REPO}:r3", "sha256:3", commit=new)])
    models = {MODEL: {"refs": {"main": new}, "snapshots": {old: ["shared", "oldw"], new: ["shared", "neww"]},
                      "blobs": {"shared": 10, "oldw": 100, "neww": 120, "stray": 3},
                      "partials": {"p.incomplete": {"size": 50, "held": False}}, "trash": [".dgemma-pruning-x"]}}
    # keep 1 keeps r2, and r2's weights are the old commit: both snapshots stay
    assert [r.kind for r in select([], {}, models, history=history).remove] == ["trash", "partial"]
    chosen = select([], {}, models, keep=0, history=history)
    snap, trash, partial = chosen.remove
    assert (snap.kind, snap.what, snap.size, snap.frees) == ("snapshot", f"{MODEL}@{old[:12]}", 110, 100)
    assert snap.params["BLOBS"] == "oldw" and snap.params["REFS"] == ""
    assert (trash.size, trash.params["BLOBS"], trash.params["TRASH"]) == (3, "stray", ".dgemma-pruning-x")
    assert (partial.frees, partial.params["BLOBS"]) == (50, "p.incomplete")
    # a download under way: its partials and the loose blobs (perhaps its own) stay
    models[MODEL]["partials"]["p.incomplete"]["held"] = True
    assert [r.kind for r in select([], {}, models, keep=0, history=history).remove] == ["snapshot"]


def sh(program: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-c", program], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def layout(hub: Path, model: str, commits: dict, refs: dict, partials=()) -> Path:
    repo = hub / ("models--" + model.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    for commit, files in commits.items():
        for name, blob in files.items():
            (repo / "blobs" / blob).write_bytes(b"x" * 10)
            link = repo / "snapshots" / commit / name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(f"../../blobs/{blob}")
    for ref, commit in refs.items():
        (repo / "refs" / ref).write_text(commit)
    for name in partials:
        (repo / "blobs" / name).write_bytes(b"y" * 4)
    return repo


def test_the_programs_read_the_cache_and_remove_a_snapshot_whole_leaving_other_models(tmp_path):
    hub = tmp_path / "hub"
    old, new = "a" * 40, "b" * 40
    repo = layout(hub, MODEL, {old: {"config.json": "s", "w.bin": "o"}, new: {"config.json": "s", "w.bin": "n"}},
                  {"main": new, "v1": old}, partials=("q.incomplete",))
    foreign = layout(hub, "someone/other", {old: {"w.bin": "f"}}, {"main": old})
    history = tmp_path / "releases"
    history.write_text(line(f"{REPO}:r1", "sha256:1", commit=old) + "\n" + line(f"{REPO}:r2", "sha256:2", commit=new) + "\n")
    fact = prune.PruneFacts({"container_runtime": "none", "model_cache": str(tmp_path)})
    fact.command = fact.command.replace("/var/lib/dgemma/vllm-diffusiongemma.releases", str(history))
    seen = fact.process(sh(fact.standalone()).stdout, 0)
    assert set(seen["models"]) == {MODEL}  # the history names no other
    entry = seen["models"][MODEL]
    assert entry["refs"] == {"main": new, "v1": old}
    assert {c: sorted(b) for c, b in entry["snapshots"].items()} == {old: ["o", "s"], new: ["n", "s"]}
    assert entry["partials"] == {"q.incomplete": {"size": 4, "held": False}}
    chosen = prune.select(parse_history(history.read_text()), [], {}, seen["models"], 0, {"vllm/vllm-openai"}, set(),
                          str(tmp_path))
    snap = next(r for r in chosen.remove if r.kind == "snapshot")
    assert snap.params["REFS"] == "v1" and snap.params["BLOBS"] == "o"
    for removal in chosen.remove:
        done = sh(prune.REMOVE_PROGRAM.script(prune._params({}, removal)))
        assert done.returncode == 0, done.stderr
        assert prune.REMOVE.result_of(done.stdout)["removed"]
    assert sorted(p.name for p in (repo / "blobs").iterdir()) == ["n", "s"]
    assert [p.name for p in (repo / "snapshots").iterdir()] == [new]
    assert [p.name for p in (repo / "refs").iterdir()] == ["main"]
    assert not list(repo.glob(".dgemma-pruning-*"))
    assert (foreign / "blobs" / "f").exists() and (foreign / "snapshots" / old / "w.bin").exists()


def test_a_partial_download_a_download_holds_is_kept(tmp_path):
    repo = layout(tmp_path / "hub", MODEL, {}, {}, partials=("q.incomplete",))
    removal = prune.Removal("partial", "x", 4, 4, {"REPO": str(repo), "BLOBS": "q.incomplete"})
    holder = subprocess.Popen(["flock", str(repo / "blobs" / "q.lock"), "sleep", "30"])
    try:
        for _ in range(100):
            if sh(f"flock -n {repo}/blobs/q.lock true").returncode:
                break
        done = sh(prune.REMOVE_PROGRAM.script(prune._params({}, removal)))
        assert prune.REMOVE.result_of(done.stdout) == {"removed": "", "kept": "q.incomplete:held"}
    finally:
        holder.kill()
    assert (repo / "blobs" / "q.incomplete").exists()


def test_the_release_is_recorded_once_with_the_digest_and_commit_the_host_holds(tmp_path):
    record = tmp_path / "svc.image"
    record.write_text(f"{REPO}:r2\nsha256:2\namd64\n")
    refs = tmp_path / "main"
    refs.write_text("c" * 40)
    history = tmp_path / "svc.releases"
    history.write_text(line(f"{REPO}:r1", "sha256:1") + "\n")
    rows = f"unit={UNIT} image={REPO}:r2 model={MODEL} revision=main refs={refs}"

    def record_once():
        done = sh(RECORD_PROGRAM.script({"HISTORY": history, "RECORD": record, "STATE_DIR": tmp_path, "KEEP_LINES": 3,
                                         "RELEASES": rows}))
        assert done.returncode == 0, done.stderr
        return RECORD.result_of(done.stdout)["recorded"]

    assert record_once() == UNIT
    assert record_once() == ""  # the same release: no second line
    releases = parse_history(history.read_text())
    assert [(r.image, r.digest, r.commit) for r in releases] == [(f"{REPO}:r1", "sha256:1", "c" * 40),
                                                                  (f"{REPO}:r2", "sha256:2", "c" * 40)]
    for n in range(3, 6):  # the file keeps its newest KEEP_LINES lines
        record.write_text(f"{REPO}:r{n}\nsha256:{n}\namd64\n")
        rows = rows.replace(f"r{n - 1}", f"r{n}") if n > 3 else rows.replace("r2", "r3")
        assert record_once() == UNIT
    assert [r.image.rsplit(":", 1)[1] for r in parse_history(history.read_text())] == ["r3", "r4", "r5"]


@pytest.mark.parametrize("ref,repo", [(f"{REPO}:r1", "vllm/vllm-openai"), ("vllm/vllm-openai:v1", "vllm/vllm-openai"),
                                      (f"{REPO}@sha256:1", "vllm/vllm-openai"), ("busybox:1", "library/busybox")])
def test_a_repository_is_the_same_through_any_registry(ref, repo):
    assert prune.repository(ref) == repo


def answer(body, status="200", kind=""):
    return {"status": status, "type": kind, "body": base64.b64encode(body.encode()).decode(), "why": ""}


def test_an_images_size_is_read_from_its_registrys_manifest_before_a_pull():
    from roles.image.registry import locate, read_answer
    pushed = (DATA / "manifest-r4-x86_64.json").read_text()  # what the lab's registry answered for a release
    size = read_answer(answer(pushed, kind="application/vnd.oci.image.manifest.v1+json"), "amd64").size
    doc = json.loads(pushed)
    assert size == sum(layer["size"] for layer in doc["layers"]) + doc["config"]["size"] and size > 2_000_000
    index = json.dumps({"mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {"digest": "sha256:a", "platform": {"architecture": "amd64", "os": "linux"}},
        {"digest": "sha256:b", "platform": {"architecture": "arm64", "os": "linux"}}]})
    assert read_answer(answer(index), "arm64").platform_digest == "sha256:b"
    assert "lists no riscv64 image (it has amd64, arm64)" in read_answer(answer(index), "riscv64").unknown
    assert read_answer(answer("", status="401"), "amd64").unknown == "the registry answered 401"
    assert "could not be read" in read_answer(answer("{not json"), "amd64").unknown
    assert locate("vllm/vllm-openai:v0.33.0-x86_64") == ("registry-1.docker.io", "vllm/vllm-openai", "v0.33.0-x86_64")
    assert locate("haproxy:3.0") == ("registry-1.docker.io", "library/haproxy", "3.0")
    assert locate("10.213.0.1:5000/vllm/vllm-openai@sha256:ab") == ("10.213.0.1:5000", "vllm/vllm-openai", "sha256:ab")


class Registry:
    """A registry on loopback that answers as Docker Hub does: 401 with a Bearer challenge, a token
    from its realm, then the manifest for a request that carries the token."""

    def __init__(self, manifest: str):
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
        owner = self
        self.asked = []

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.asked.append((self.path, self.headers.get("Authorization"), self.headers.get("Accept")))
                if self.path.startswith("/token?"):
                    status, body, kind = 200, json.dumps({"token": "t0k3n"}), "application/json"
                elif self.headers.get("Authorization") != "Bearer t0k3n":
                    status, body, kind = 401, "{}", "application/json"
                else:
                    status, body, kind = 200, manifest, "application/vnd.oci.image.manifest.v1+json"
                data = body.encode()
                self.send_response(status)
                self.send_header("Content-Type", kind)
                if status == 401:
                    self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{owner.port}/token",'
                                                         f'service="registry.test",scope="repository:vllm/vllm-openai:pull"')
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_manifest_program_answers_a_bearer_challenge_and_keeps_the_token_off_the_command_line():
    from roles.image.registry import read_answer
    from roles.image.role import MANIFEST, MANIFEST_PROGRAM
    pushed = (DATA / "manifest-r4-x86_64.json").read_text()
    registry = Registry(pushed)
    try:
        script = MANIFEST_PROGRAM.script({"REGISTRY": f"127.0.0.1:{registry.port}", "REPOSITORY": "vllm/vllm-openai",
                                          "REFERENCE": "v1"})
        assert "t0k3n" not in script
        done = sh(script)
    finally:
        registry.server.shutdown()
        registry.server.server_close()
    said = MANIFEST.result_of(done.stdout)
    assert said["status"] == 200 and read_answer(said, "amd64").size > 2_000_000, said
    paths = [(path, auth) for path, auth, _ in registry.asked]
    assert paths[0] == ("/v2/vllm/vllm-openai/manifests/v1", None)
    assert paths[1][0].startswith("/token?") and "scope=repository%3avllm%2fvllm-openai%3apull" in paths[1][0].lower()
    assert paths[2] == ("/v2/vllm/vllm-openai/manifests/v1", "Bearer t0k3n")
    assert "application/vnd.oci.image.index.v1+json" in registry.asked[0][2]


def test_the_disk_textfile_says_what_the_fleet_takes_and_what_prune_frees():
    chosen = prune.Selection([prune.Removal("image", "r1", 50, 30), prune.Removal("snapshot", "m@a", 20, 12),
                              prune.Removal("partial", "m", 4, 4)], [], images_bytes=500, weights_bytes=200)
    before = prune.disk_textfile(chosen)
    assert 'dgemma_fleet_disk_bytes{kind="images"} 500\n' in before and 'dgemma_prunable_bytes{kind="images"} 30\n' in before
    assert 'dgemma_prunable_bytes{kind="weights"} 16\n' in before
    after = prune.disk_textfile(chosen, removed=True)
    assert 'dgemma_fleet_disk_bytes{kind="images"} 470\n' in after and 'dgemma_fleet_disk_bytes{kind="weights"} 184\n' in after
    assert 'dgemma_prunable_bytes{kind="images"} 0\n' in after


def test_images_that_cannot_be_listed_fail_the_host_saying_why():
    from types import SimpleNamespace

    from converge.errors import StepFailed
    from converge.facts import Facts
    facts = Facts(values={}, errors={"images": "podman: command not found"})
    with pytest.raises(StepFailed, match="the images could not be listed: podman: command not found"):
        prune.selection(SimpleNamespace(facts=facts, vars={}), 1)
