"""Fetching a model into a host's Hugging Face cache with the host's curl. Pure: the
programs it sends (files/manifest.sh and files/fetch.sh, after files/hub.sh) with their
parameters, and the reading of what they print (their protocols' markers).

Why not the image's ``hf download``: it needs the image first (no overlap with
the pull); huggingface_hub 2.4 writes each download to a per-process temporary
file and deletes it on failure, so nothing resumes across runs (and a crashed
run's partials stay forever); and its files are hashed only by a second read.
Here, on the host:
- the manifest (commit, files, sizes, sha256 of LFS files) comes from the hub's
  API, as ``hf`` reads it; the control side parses it;
- each file goes to ``blobs/<id>.incomplete`` (a stable name: a later run
  resumes it with a Range request) and its hash is computed as the bytes stream
  (sha256 for LFS files, git's blob sha1 for the others); whole and right, it is
  renamed to ``blobs/<id>``; wrong, deleted and fetched again once;
- then ``snapshots/<commit>/<path>`` links and ``refs/<revision>``, the layout
  ``hf`` and vLLM read offline; every blob hashed is recorded (name, size, mtime)
  in ``.dgemma-verified``, so no later run hashes it again.
A token (HF_TOKEN) travels inside the script on stdin (base64, a parameter) and reaches
curl in its config on curl's stdin: never in argv or the environment. The manifest's
files go to fetch.sh as a table, a line a file of NAME=VALUE words (its path in base64:
a path may hold a blank), read there by name.
"""
from __future__ import annotations

import base64
import json
import re
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from converge.changes import Transfer
from converge.errors import StepFailed
from serving.host_programs import NAME_VALUE_TABLE, RESULT_LIBRARY, Program, ProgramResultError, Protocol, decoded

from .cache import VERIFIED, repo_dir

SHA256 = re.compile(r"^[0-9a-f]{64}$")
SHA1 = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class HubFile:
    path: str
    size: int
    blob: str  # its name in blobs/: the sha256 of an LFS file, git's blob sha1 otherwise
    lfs: bool


@dataclass(frozen=True)
class Manifest:
    repo: str
    revision: str
    commit: str
    files: tuple

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)


FILES = Path(__file__).parent / "files"
HUB = FILES / "hub.sh"  # the token and curl, shared by both programs
MANIFEST = Protocol("manifest", result={
    "revision_status": "the hub's HTTP status for the revision (error: curl failed, said in why)",
    "revision": "its answer (base64)", "commit": "SHA: the commit the tree is read for (blank: none named)",
    "tree_status": "each page of the file tree: its status, blank-separated", "tree": "each page's answer (base64), "
    "blank-separated", "why": "curl's error, when a status is error"})
MANIFEST_PROGRAM = Program((RESULT_LIBRARY, HUB, FILES / "manifest.sh"), MANIFEST)
FETCH = Protocol("download", markers={
    "bytes": "N: how many of the files' bytes are here",
    "corrupt": "BLOB GOT: its hash was GOT; deleted, fetched again",
    "partial": "BLOB NOW SIZE RC ERROR: a try ended at NOW of SIZE bytes (curl's exit RC)",
    "relay-failed": "BLOB: the run's relay gave nothing; from the hub itself from here on",
    "busy": "BLOB: another download of it on this host kept its lock for 15 minutes",
    "failed": "BLOB: given up after its tries"},
    exits={"failed": 3, "no_space": 4, "no_folder": 5}, result={
        "outcome": "complete (every file here, the snapshot and ref laid out), failed, no-space (nothing fetched) "
                   "or no-folder", "commit": "the commit laid out (complete)",
        "need": "bytes still to fetch when it began", "free": "bytes free then"})
FETCH_PROGRAM = Program((RESULT_LIBRARY, HUB, NAME_VALUE_TABLE, FILES / "fetch.sh"), FETCH)


def _token(token: str | None) -> str:
    """The token as the programs take it (hub.sh): base64, so that any byte of it is one word."""
    return base64.b64encode((token or "").encode()).decode()


def manifest_script(endpoint: str, repo: str, revision: str, token: str | None) -> str:
    """Print the revision's JSON, the commit used, then every page of its file tree (files/manifest.sh)."""
    base = endpoint.rstrip("/")
    return MANIFEST_PROGRAM.script({"TOKEN_B64": _token(token), "STALL_S": 20,
                                    "REVISION_URL": f"{base}/api/models/{repo}/revision/{quote(revision, safe='')}",
                                    "TREE_URL": f"{base}/api/models/{repo}/tree/"})


def _sections(said: dict) -> list[tuple[str, str, str]]:
    """(kind, status, body) of the revision's answer and of each page of the tree, from the result."""
    def status(code) -> str:
        return f"error {said['why']}".strip() if str(code) == "error" else str(code)
    pages = str(said["tree"]).split(" ") if str(said["tree_status"]) else []
    codes = str(said["tree_status"]).split()
    if len(pages) != len(codes):
        raise ProgramResultError(f"{len(codes)} tree statuses for {len(pages)} pages")
    return [("revision", status(said["revision_status"]), decoded(said["revision"], "the revision's answer")),
            *(("tree", status(code), decoded(page, "a page of the tree")) for code, page in zip(codes, pages))]


def parse_manifest(output: str, repo: str, revision: str, endpoint: str) -> Manifest:
    """The manifest, or StepFailed saying what the hub answered."""
    try:
        said = MANIFEST.result_of(output)
        sections = _sections(said)
    except ProgramResultError as exc:
        raise StepFailed(f"no answer from {endpoint} for {repo}: {exc}") from None
    kind, status, body = sections[0]
    if status != "200":
        hint = {"401": "it needs a token: set hf_token_file", "403": "the token may not read it (a gated model? "
                "accept its licence on the hub)", "404": f"no such model or revision ({repo}@{revision})"}
        raise StepFailed(f"{endpoint} answered {status} for {repo}@{revision}"
                         f"{': ' + hint[status] if status in hint else ''}")
    try:
        commit = json.loads(body)["sha"]
    except (ValueError, KeyError, TypeError) as exc:
        raise StepFailed(f"{endpoint} sent a revision that is not the hub's JSON: {body[:200]!r}") from exc
    if not isinstance(commit, str) or not SHA1.match(commit):
        raise StepFailed(f"{endpoint} sent a commit that is not a git sha1: {str(commit)[:80]!r}")
    if str(said["commit"]) != commit:
        raise StepFailed(f"the file list of {repo} was read for another commit than {commit[:12]}: try again")
    files = []
    for kind, status, body in sections[1:]:
        if status != "200":
            raise StepFailed(f"{endpoint} answered {status} for the file list of {repo}@{commit[:12]}")
        try:
            entries = json.loads(body)
        except ValueError as exc:
            raise StepFailed(f"{endpoint} sent a file list that is not JSON: {body[:200]!r}") from exc
        for entry in entries if isinstance(entries, list) else []:
            if not isinstance(entry, dict) or entry.get("type") != "file":
                continue
            path, lfs = entry.get("path"), entry.get("lfs")
            blob = (lfs or {}).get("oid") if lfs else entry.get("oid")
            size = (lfs or {}).get("size", entry.get("size")) if lfs else entry.get("size")
            if not isinstance(path, str) or not path or path.startswith("/") or ".." in path.split("/") \
                    or "\n" in path or not isinstance(size, int) or size < 0 or not isinstance(blob, str) \
                    or not (SHA256 if lfs else SHA1).match(blob):
                raise StepFailed(f"{endpoint} listed a file this toolkit cannot trust: {str(entry)[:200]}")
            files.append(HubFile(path, size, blob, bool(lfs)))
    if not files:
        raise StepFailed(f"{endpoint} lists no files for {repo}@{commit[:12]}")
    return Manifest(repo, revision, commit, tuple(files))


def _link_target(path: str) -> str:
    """``snapshots/<commit>/<path>`` -> ``../../blobs/<id>``, as deep as the path is."""
    return "../" * (path.count("/") + 2) + "blobs/"


def fetch_script(cache: str, manifest: Manifest, endpoint: str, token: str | None, relay=None,
                 stall_s: int = 20) -> str:
    """Fetch every missing file of the manifest, then lay out the snapshot and ref (files/fetch.sh).
    ``relay``: upstream URL -> the run's relay URL for it (the hub is the fallback);
    ``stall_s``: seconds without a byte before a try of a blob is given up."""
    base = endpoint.rstrip("/")
    rows = []
    for f in manifest.files:
        url = f"{base}/{manifest.repo}/resolve/{manifest.commit}/{quote(f.path)}"
        first, alt = (relay(url), url) if relay else (url, "")
        fields = {"blob": f.blob, "size": f.size, "algo": "sha256" if f.lfs else "sha1", "url": first, "alt": alt,
                  "link": _link_target(f.path) + f.blob, "path": base64.b64encode(f.path.encode()).decode()}
        if any(c.isspace() for value in fields.values() for c in str(value)):
            raise StepFailed(f"{f.path}: its address holds a blank ({first}): the hub's listing cannot be trusted")
        rows.append(" ".join(f"{name}={value}" for name, value in fields.items()))
    return FETCH_PROGRAM.script({"REPO": f"{cache.rstrip('/')}/hub/{repo_dir(manifest.repo)}",
                                 "COMMIT": manifest.commit, "REF": manifest.revision, "VERIFIED_NAME": VERIFIED,
                                 "STALL_S": int(stall_s), "TOKEN_B64": _token(token), "FILES": "\n".join(rows)})


def progress_reader(total: int):
    """The fetch's ``@bytes N`` lines as a Transfer of the manifest's ``total``."""
    def read(line: str) -> Transfer | None:
        word, _, rest = line.partition(" ")
        if word != "@bytes" or not rest.strip().isdigit():
            return None
        return Transfer(min(int(rest), total), total)
    return read


def parse_fetch(output: str) -> dict:
    """What a fetch printed: how it ended (its result; None when it has none: it was cut off), and
    its markers: blobs fetched again after a bad hash, partial ones, those given up or held by
    another download."""
    try:
        said = FETCH.result_of(output)
    except ProgramResultError:
        said = None
    return {"result": said,
            "corrupt": [m[0] for m in FETCH.every(output, "corrupt") if m],
            "partial": [" ".join(m) for m in FETCH.every(output, "partial")],
            "failed": [m[0] for m in FETCH.every(output, "failed") if m],
            "busy": [m[0] for m in FETCH.every(output, "busy") if m],
            "relay_failed": [m[0] for m in FETCH.every(output, "relay-failed") if m]}
