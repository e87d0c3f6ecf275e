"""The weights role's view of a Hugging Face cache (roles/weights/cache.py): its program
(files/cache.sh) run for real under sh on a cache built here, then read and judged."""
import hashlib
import os
import subprocess

from roles.weights.cache import VERIFIED, HfCache, status

COMMIT = "c0ffee" + "0" * 34


def cache(tmp_path, verified=True, broken=False, partial=False):
    repo = tmp_path / "hub" / "models--google--diffusiongemma-26B-A4B-it"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    blobs, snap = repo / "blobs", repo / "snapshots" / COMMIT
    blobs.mkdir()
    snap.mkdir(parents=True)
    records = []
    for name, data in (("config.json", b'{"a": 1}'), ("model.safetensors", b"\0" * 4096)):
        digest = hashlib.sha256(data).hexdigest()
        (blobs / digest).write_bytes(data)
        os.symlink(f"../../blobs/{digest}", snap / name)
        st = (blobs / digest).stat()
        records.append(f"{digest} {st.st_size} {int(st.st_mtime)}")
    if broken:
        os.symlink("../../blobs/" + "f" * 64, snap / "tokenizer.json")
    if partial:
        (blobs / ("e" * 64 + ".incomplete")).write_bytes(b"x")
    if verified:
        (repo / VERIFIED).write_text("\n".join(records) + "\n")
    return tmp_path


def read(root):
    fact = HfCache(str(root))
    out = subprocess.run(["sh", "-s"], input=fact.command, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return fact.process(out.stdout, 0)


def test_a_complete_and_verified_snapshot_reads_complete(tmp_path):
    models = read(cache(tmp_path))
    assert list(models) == ["google/diffusiongemma-26B-A4B-it"]
    assert status(models, "google/diffusiongemma-26B-A4B-it") == (True, f"{COMMIT[:12]}, 2 blobs verified")
    assert status(models, "google/gemma-4-26B-A4B-it") == (False, "not in the cache")


def test_each_way_a_cache_is_not_complete_is_named(tmp_path):
    model = "google/diffusiongemma-26B-A4B-it"
    assert status(read(cache(tmp_path / "a", broken=True)), model) == \
        (False, "1 snapshot files point at missing blobs")
    assert status(read(cache(tmp_path / "b", partial=True)), model) == (False, "1 partial downloads (.incomplete)")
    assert status(read(cache(tmp_path / "c", verified=False)), model)[1].endswith("not verified")
    assert read(tmp_path / "empty") == {}  # no cache at all: nothing, not an error
