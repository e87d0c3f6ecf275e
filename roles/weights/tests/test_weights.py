"""The weights role's state on the host: the same test of completeness, with every blob hashed."""
import shlex

from roles.weights.cache import repo_dir


def test_weights_snapshot_complete(host, expected, fix):
    for model in expected["models"]:
        _complete(host, expected, model, fix)


def _complete(host, expected, model, fix):
    repo = f"{expected['model_cache'].rstrip('/')}/hub/{repo_dir(model)}"
    q = shlex.quote(repo)
    ref = host.file(f"{repo}/refs/{expected['model_revision']}")
    assert ref.exists, f"{model}: no refs/{expected['model_revision']} in {repo}; {fix}"
    commit = ref.content_string.strip()
    snap = host.run(f"find {q}/snapshots/{shlex.quote(commit)} -type l | wc -l; "
                    f"find {q}/snapshots/{shlex.quote(commit)} -xtype l")
    count, *broken = snap.stdout.split("\n")
    assert int(count or 0) > 0, f"{model}: snapshot {commit[:12]} is empty; {fix}"
    assert not [b for b in broken if b], f"{model}: missing blobs for {broken}; {fix}"
    partial = host.run(f"ls {q}/blobs | grep -c '\\.incomplete$' || true").stdout.strip()
    assert partial == "0", f"{model}: {partial} partial downloads; {fix}"
    bad = host.run(f"cd {q}/blobs && for f in *; do case $f in *[!0-9a-f]*) continue;; esac; "
                   f"[ ${{#f}} -eq 64 ] || continue; s=$(sha256sum \"$f\" | cut -d' ' -f1); "
                   f"[ \"$s\" = \"$f\" ] || echo \"$f\"; done")
    assert bad.stdout.strip() == "", f"{model}: blobs whose sha256 is not their name: " \
                                     f"{bad.stdout.split()}; {fix} (it downloads them again)"
