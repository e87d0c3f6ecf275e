# shellcheck shell=dash
# A model's files into a host's Hugging Face cache (download.py: fetch_script, parse_fetch):
# each missing blob of $FILES fetched whole, resumably, and hashed as it streams; then the
# snapshot's links and the ref, the layout hf and vLLM read offline.
#
# $REPO the model's folder of the cache, $COMMIT its commit, $REF the revision asked for,
# $VERIFIED_NAME the name of the record of the blobs hashed (name, size, mtime: never hashed again);
# $FILES a line a file, NAME=VALUE words: blob (its id), size, algo (sha256 or sha1), url (where
# it is fetched), alt (the hub itself when url is the run's relay; empty: none), link (the
# snapshot link's target) and path (its path in the snapshot, base64: a path may hold a blank).
# Says @bytes N every 2 s (how many of the files' bytes are here), @corrupt, @partial,
# @relay-failed, @busy and @failed of a blob as they come; ends with its result: outcome
# (complete, failed, no-space: nothing fetched, or no-folder), commit (the one laid out, when
# complete), need and free (the bytes still to fetch when it began, and those free then).
umask 022
need=0 free=0
ended() { result outcome="$1" commit="${2:-}" need="$need" free="$free"; }
mkdir -p "$REPO/blobs" "$REPO/refs" "$REPO/snapshots/$COMMIT" || { ended no-folder; exit "$EXIT_NO_FOLDER"; }
# this run's record of what it hashed, merged into the shared one at the end
verified="$REPO/$VERIFIED_NAME" record=$(mktemp "$REPO/.$VERIFIED_NAME.XXXXXX")
# hf's per-process partials (<id>.<8 hex>.incomplete): never resumed by anyone
rm -f "$REPO"/blobs/*.????????.incomplete

# the fields of each file of $FILES that the arguments name, in that order, "-" for an empty one
files() {
  printf '%s\n' "$FILES" | awk -v names="$*" "$ROW_AWK"' BEGIN { n = split(names, want, " ") } NF { fields()
    line = ""; for (k = 1; k <= n; k++) line = line (k > 1 ? " " : "") (f[want[k]] == "" ? "-" : f[want[k]]); print line }'
}
# how many of the files' bytes are here, now and every 2 s, for the progress display (sleep away
# from our stdout: the channel must not wait for it at the end)
set --
for blob in $(files blob); do set -- "$@" "$REPO/blobs/$blob" "$REPO/blobs/$blob.incomplete"; done
here() { stat -c %s "$@" 2>/dev/null | awk '{n += $1} END {print "@bytes", n + 0}'; }
( while :; do here "$@"; sleep 2 >/dev/null 2>&1 || break; done ) &
ticker=$!
trap 'kill $ticker 2>/dev/null; rm -f "$record"' EXIT
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
  ( flock -w 900 9 || { echo "@busy $2"; exit 1; }; fetch_locked "$@" ) 9>"$REPO/blobs/$2.lock"
}
fetch_locked() {
  url=$1 blob=$2 size=$3 algo=$4 alt=${5:-}  # alt: the hub itself, when url is the run's relay
  dest="$REPO/blobs/$blob" part="$REPO/blobs/$blob.incomplete"
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
               { auth | hub_curl -C "$have" "$url" 2>"$part.err"; echo $? > "$part.rc"; } | tee -a "$part"; } \
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

# room for what is missing, before anything is fetched
while read -r blob size <&3; do
  [ -f "$REPO/blobs/$blob" ] || need=$((need + size - $(stat -c %s "$REPO/blobs/$blob.incomplete" 2>/dev/null || echo 0)))
done 3<<FILES
$(files blob size)
FILES
free=$(( $(df -Pk "$REPO/blobs" | awk 'NR == 2 {print $4}') * 1024 ))
if [ "$need" -gt "$free" ]; then ended no-space; exit "$EXIT_NO_SPACE"; fi
failed=0
while read -r url blob size algo alt <&3; do
  [ "$alt" = "-" ] && alt=""
  fetch "$url" "$blob" "$size" "$algo" "$alt" || failed=1
done 3<<FILES
$(files url blob size algo alt)
FILES
( flock 8; { cat "$verified" 2>/dev/null; cat "$record"; } | sort -u > "$record.all" && mv -f "$record.all" "$verified" ) 8>"$verified.lock"
kill $ticker 2>/dev/null; here "$@"  # the last word on how far it came
[ $failed = 0 ] || { ended failed; exit "$EXIT_FAILED"; }
snap="$REPO/snapshots/$COMMIT"
while read -r path64 link <&3; do
  path=$(printf '%s' "$path64" | base64 -d)
  case $path in */*) mkdir -p "$snap/${path%/*}";; esac
  ln -sfn "$link" "$snap/$path"
done 3<<FILES
$(files path link)
FILES
printf %s "$COMMIT" > "$REPO/refs/.$REF.tmp" && mv -f "$REPO/refs/.$REF.tmp" "$REPO/refs/$REF"
ended complete "$COMMIT"
