"""Fetching a model into a host's Hugging Face cache with the host's curl. Pure:
the scripts it sends and the parsing of what they print.

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
A token (HF_TOKEN) travels inside the script on stdin and reaches curl in its
config on curl's stdin: never in argv or the environment.
"""
from __future__ import annotations

import base64
import json
import posixpath
import re
import shlex
from dataclasses import dataclass
from urllib.parse import quote

from converge.changes import Transfer
from converge.errors import StepFailed

from .cache import VERIFIED, repo_dir

SHA256 = re.compile(r"^[0-9a-f]{64}$")
SHA1 = re.compile(r"^[0-9a-f]{40}$")


def curl_command(stall_s: int = 20) -> str:
    """curl as every fetch runs it: its options (the token's header) on its stdin, and a
    connection given up after ``stall_s`` seconds without a byte."""
    return f"curl -sSL -K - --connect-timeout 15 --speed-limit 1 --speed-time {int(stall_s)}"


CURL = curl_command()


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


def _token_lines(token: str | None) -> str:
    """The token into a shell variable, from a heredoc (the script is on stdin), and
    ``auth``, which prints curl's config with it."""
    payload = base64.b64encode((token or "").encode()).decode()
    return (f"token=$(base64 -d <<'__DGEMMA_TOKEN__'\n{payload}\n__DGEMMA_TOKEN__\n)\n"
            "auth() { [ -z \"$token\" ] || printf 'header = \"Authorization: Bearer %s\"\\n' \"$token\"; }\n")


def manifest_script(endpoint: str, repo: str, revision: str, token: str | None) -> str:
    """Print the revision's JSON, the commit used, then every page of its file tree."""
    base = endpoint.rstrip("/")
    revision_url = f"{base}/api/models/{repo}/revision/{quote(revision, safe='')}"
    tree_url = f"{base}/api/models/{repo}/tree/"
    return _token_lines(token) + f"""
get() {{  # URL [FILE]: @status CODE, the body, @end (the body kept in FILE when given)
  body=${{2:-$(mktemp)}}; hdr=$(mktemp)
  code=$(auth | {CURL} --max-time 120 -D "$hdr" -o "$body" -w '%{{http_code}}' "$1" 2>"$hdr.err") \
    || code="error $(tr '\\n' ' ' < "$hdr.err" | cut -c1-200)"
  printf '@status %s\\n' "$code"; cat "$body"; printf '\\n@end\\n'
  next=$(sed -n 's/^[Ll]ink: *<\\([^>]*\\)>; *rel="next".*/\\1/p' "$hdr" | tr -d '\\r' | tail -n 1)
  rm -f "$hdr" "$hdr.err"; [ -n "${{2:-}}" ] || rm -f "$body"
}}
rev=$(mktemp)
printf '@revision\\n'; get {shlex.quote(revision_url)} "$rev"
commit=$(sed -n 's/.*"sha" *: *"\\([0-9a-f]\\{{40\\}}\\)".*/\\1/p' "$rev" | head -n 1); rm -f "$rev"
[ -n "$commit" ] || exit 0
printf '@commit %s\\n' "$commit"
url={shlex.quote(tree_url)}"$commit?recursive=true&expand=false"
pages=0
while [ -n "$url" ] && [ $pages -lt 200 ]; do
  printf '@tree\\n'; get "$url"; url=$next; pages=$((pages + 1))
done
"""


def _sections(output: str) -> list[tuple[str, str, str]]:
    """(kind, status, body) of each ``@revision`` / ``@tree`` answer."""
    found = []
    for match in re.finditer(r"^@(revision|tree)\n@status ([^\n]*)\n(.*?)\n@end$", output, re.M | re.S):
        found.append((match.group(1), match.group(2).strip(), match.group(3)))
    return found


def parse_manifest(output: str, repo: str, revision: str, endpoint: str) -> Manifest:
    """The manifest, or StepFailed saying what the hub answered."""
    sections = _sections(output)
    if not sections:
        raise StepFailed(f"no answer from {endpoint} for {repo}: {output.strip()[-300:]!r}")
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
    used = re.search(r"^@commit (\S+)$", output, re.M)
    if not used or used.group(1) != commit:
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


FETCH = r"""
# openssl's sha256 is several times coreutils' where the CPU has SHA instructions (4
# hosts hashing 50 MB/s each on 2 cores kept up only with it); sha256sum where it is not
if [ "$(printf '' | openssl dgst -sha256 -r 2>/dev/null | cut -c1-16)" = e3b0c44298fc1c14 ]; then
  h256() { openssl dgst -sha256 -r | cut -d' ' -f1; }; h1() { openssl dgst -sha1 -r | cut -d' ' -f1; }
else
  h256() { sha256sum | cut -d' ' -f1; }; h1() { sha1sum | cut -d' ' -f1; }
fi
digest() {  # ALGO SIZE < data: LFS files by sha256, the others by git's blob sha1
  if [ "$1" = sha256 ]; then h256; else { printf 'blob %s\000' "$2"; cat; } | h1; fi
}
fetch() {  # URL BLOB SIZE ALGO: the blob whole and hashed, or @failed
  # one download of a blob at a time: a run that lost its connection may still be
  # fetching it here (its command runs on); wait for it rather than write the same file
  # (the lock file stays: removing it would let a waiter and a newcomer lock two files)
  ( flock -w 900 9 || { echo "@busy $2"; exit 1; }; fetch_locked "$@" ) 9>"$repo/blobs/$2.lock"
}
fetch_locked() {
  url=$1 blob=$2 size=$3 algo=$4 alt=${5:-}  # alt: the hub itself, when url is the run's relay
  dest="$repo/blobs/$blob" part="$repo/blobs/$blob.incomplete"
  if [ -f "$dest" ]; then
    line=$(stat -c '%n %s %Y' "$dest" | sed 's|.*/||')
    if grep -qxF "$line" "$verified" 2>/dev/null; then echo "$line" >> "$record"; return 0; fi
    got=$(digest "$algo" "$size" < "$dest")
    if [ "$got" = "$blob" ]; then echo "$line" >> "$record"; return 0; fi
    echo "@corrupt $blob $got"; rm -f "$dest"
  fi
  corrupt=0 tries=0  # three tries of a blob (each resumes), a second fetch after a bad hash
  while [ $tries -lt 3 ]; do
    have=$(stat -c %s "$part" 2>/dev/null || echo 0)
    [ "$have" -le "$size" ] || { rm -f "$part"; have=0; }
    if [ "$have" -lt "$size" ] || [ "$size" = 0 ]; then
      got=$( { cat "$part" 2>/dev/null
               { auth | CURL -C "$have" "$url" 2>"$part.err"; echo $? > "$part.rc"; } | tee -a "$part"; } \
             | digest "$algo" "$size")
      rc=$(cat "$part.rc" 2>/dev/null || echo 1)
    else
      got=$(digest "$algo" "$size" < "$part")
      rc=0
    fi
    now=$(stat -c %s "$part" 2>/dev/null || echo 0)
    if [ "$rc" != 0 ] || [ "$now" != "$size" ]; then
      echo "@partial $blob $now $size $rc $(tr '\n' ' ' < "$part.err" 2>/dev/null | cut -c1-300)"
      if [ -n "$alt" ] && [ "$now" -le "$have" ]; then  # the relay gave nothing: the hub itself, from here on
        echo "@relay-failed $blob"; url=$alt alt=""; continue
      fi
      tries=$((tries + 1))
      [ $tries -lt 3 ] && sleep 1
      continue
    fi
    rm -f "$part.rc" "$part.err"
    if [ "$got" = "$blob" ]; then
      mv -f "$part" "$dest"
      stat -c '%n %s %Y' "$dest" | sed 's|.*/||' >> "$record"
      return 0
    fi
    echo "@corrupt $blob $got"; rm -f "$part"
    corrupt=$((corrupt + 1)); [ $corrupt -ge 2 ] && break
  done
  rm -f "$part.rc" "$part.err"
  echo "@failed $blob"
  return 1
}
"""


def fetch_script(cache: str, manifest: Manifest, endpoint: str, token: str | None, relay=None,
                 stall_s: int = 20) -> str:
    """Fetch every missing file of the manifest, then lay out the snapshot and ref.
    ``relay``: upstream URL -> the run's relay URL for it (the hub is the fallback);
    ``stall_s``: seconds without a byte before a try of a blob is given up."""
    repo = f"{cache.rstrip('/')}/hub/{repo_dir(manifest.repo)}"
    base = endpoint.rstrip("/")
    q = shlex.quote
    lines = ["umask 022", f"repo={q(repo)}",
             f'mkdir -p "$repo/blobs" "$repo/refs" "$repo/snapshots/{manifest.commit}" || exit 5',
             _token_lines(token),
             # this run's record of what it hashed, merged into the shared one at the end
             f'verified="$repo/{VERIFIED}" record=$(mktemp "$repo/.{VERIFIED}.XXXXXX")',
             # hf's per-process partials (<id>.<8 hex>.incomplete): never resumed by anyone
             'rm -f "$repo"/blobs/*.????????.incomplete',
             # how many of the manifest's bytes are here, now and every 2 s, for the progress
             # display (sleep away from our stdout: the channel must not wait for it at the end)
             "set --",
             *(f'set -- "$@" "$repo/blobs/{f.blob}" "$repo/blobs/{f.blob}.incomplete"' for f in manifest.files),
             "here() { stat -c %s \"$@\" 2>/dev/null | awk '{n += $1} END {print \"@bytes\", n + 0}'; }",
             "( while :; do here \"$@\"; sleep 2 </dev/null >/dev/null 2>&1 || break; done ) &",
             "ticker=$!", "trap 'kill $ticker 2>/dev/null; rm -f \"$record\"' EXIT",
             # room for what is missing, before anything is fetched
             "need=0",
             FETCH.replace("CURL", curl_command(stall_s))]
    for f in manifest.files:
        lines.append(f'[ -f "$repo/blobs/{f.blob}" ] || need=$((need + {f.size} - '
                     f'$(stat -c %s "$repo/blobs/{f.blob}.incomplete" 2>/dev/null || echo 0)))')
    lines.append('free=$(( $(df -Pk "$repo/blobs" | awk \'NR == 2 {print $4}\') * 1024 ))')
    lines.append('if [ "$need" -gt "$free" ]; then echo "@nospace $need $free"; exit 4; fi')
    lines.append("failed=0")
    for f in manifest.files:
        url = f"{base}/{manifest.repo}/resolve/{manifest.commit}/{quote(f.path)}"
        first, alt = (relay(url), url) if relay else (url, "")
        lines.append(f"fetch {q(first)} {f.blob} {f.size} {'sha256' if f.lfs else 'sha1'} {q(alt)} || failed=1")
    lines.append('( flock 8; { cat "$verified" 2>/dev/null; cat "$record"; } | sort -u > "$record.all" && '
                 'mv -f "$record.all" "$verified" ) 8>"$verified.lock"')
    lines.append('kill $ticker 2>/dev/null; here "$@"')  # the last word on how far it came
    lines.append('[ $failed = 0 ] || exit 3')
    snap = f"$repo/snapshots/{manifest.commit}"
    for f in manifest.files:
        target = _link_target(f.path) + f.blob
        parent = posixpath.dirname(f.path)
        if parent:
            lines.append(f'mkdir -p "{snap}/"{q(parent)}')
        lines.append(f'ln -sfn {q(target)} "{snap}/"{q(f.path)}')
    ref = manifest.revision
    lines.append(f'printf %s {manifest.commit} > "$repo/refs/.{ref}.tmp" && mv -f "$repo/refs/.{ref}.tmp" '
                 f'"$repo/refs/{ref}"')
    lines.append(f'echo "@complete {manifest.commit}"')
    return "\n".join(lines) + "\n"


def progress_reader(total: int):
    """The fetch's ``@bytes N`` lines as a Transfer of the manifest's ``total``."""
    def read(line: str) -> Transfer | None:
        word, _, rest = line.partition(" ")
        if word != "@bytes" or not rest.strip().isdigit():
            return None
        return Transfer(min(int(rest), total), total)
    return read


def parse_fetch(output: str) -> dict:
    """What a fetch printed: blobs fetched again after a bad hash, partial ones, failures, room."""
    out = {"corrupt": [], "partial": [], "failed": [], "nospace": None, "complete": None, "relay_failed": []}
    for line in output.splitlines():
        word, _, rest = line.partition(" ")
        if word == "@corrupt":
            out["corrupt"].append(rest.split()[0])
        elif word == "@partial":
            out["partial"].append(rest)
        elif word == "@failed":
            out["failed"].append(rest.split()[0])
        elif word == "@nospace":
            need, free = (int(x) for x in rest.split()[:2])
            out["nospace"] = (need, free)
        elif word == "@complete":
            out["complete"] = rest.strip()
        elif word == "@relay-failed":
            out["relay_failed"].append(rest.strip())
    return out
