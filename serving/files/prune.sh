# shellcheck shell=dash
# One thing prune removes (day2/prune.py), whole or not at all.
# KIND image: the image ID, by its tags TAGS (blank-separated; none: by its ID), with RUNTIME.
#   A runtime removes an image in one operation; one a container took meanwhile is refused, and
#   kept.
# KIND snapshot: the snapshot COMMIT of the model folder REPO: renamed out of snapshots/ first
#   (one rename: from there on no reader finds a half of it), then the refs that name it (REFS),
#   then the blobs BLOBS that no other snapshot links, then the renamed folder. A prune cut short
#   leaves a .dgemma-pruning-* folder and unlinked blobs, which the next prune removes.
# KIND partial: the .incomplete blobs BLOBS of REPO, each unless a download holds its lock.
# KIND trash: the folders TRASH of REPO a prune cut short left, and the blobs BLOBS no snapshot links.
# Result: removed (what went), kept (what stayed, and why).
removed=
kept=
gone() { removed="$removed${removed:+ }$1"; }
stays() { kept="$kept${kept:+ }$1"; }
linked() { find "$REPO/snapshots" -type l -exec readlink {} + 2>/dev/null | grep -q "/$1\$"; }
drop_blobs() {
  for blob in $BLOBS; do
    if linked "$blob"; then stays "$blob:linked"; elif rm -f "$REPO/blobs/$blob"; then gone "$blob"; fi
  done
}
case $KIND in
  image)
    if [ -n "$TAGS" ]; then
      # shellcheck disable=SC2086 # the tags, one word each
      if out=$("$RUNTIME" rmi $TAGS 2>&1); then gone "$ID"; else stays "$ID:$(printf '%s' "$out" | tail -n 1)"; fi
    elif out=$("$RUNTIME" rmi "$ID" 2>&1); then gone "$ID"
    else stays "$ID:$(printf '%s' "$out" | tail -n 1)"
    fi ;;
  snapshot)
    cut=$REPO/.dgemma-pruning-$COMMIT
    if [ -d "$REPO/snapshots/$COMMIT" ]; then
      mv "$REPO/snapshots/$COMMIT" "$cut"
      gone "snapshot:$COMMIT"
    fi
    for ref in $REFS; do
      [ "$(cat "$REPO/refs/$ref" 2>/dev/null)" != "$COMMIT" ] || { rm -f "$REPO/refs/$ref"; gone "ref:$ref"; }
    done
    drop_blobs
    rm -rf "$cut"
    # a model with no snapshot left: its folder goes (its locks and records with it)
    if [ -z "$(ls -A "$REPO/snapshots" 2>/dev/null)" ] && [ -z "$(ls -A "$REPO/refs" 2>/dev/null)" ]; then
      rm -rf "$REPO" && gone "folder"
    fi ;;
  partial)
    for blob in $BLOBS; do
      lock=$REPO/blobs/${blob%.incomplete}.lock
      if [ ! -e "$lock" ] && rm -f "$REPO/blobs/$blob"; then gone "$blob"
      elif [ -e "$lock" ] && flock -n "$lock" rm -f "$REPO/blobs/$blob"; then gone "$blob"
      else stays "$blob:held"; fi
    done ;;
  trash)
    for folder in $TRASH; do rm -rf "${REPO:?}/$folder" && gone "$folder"; done
    drop_blobs ;;
esac
result removed="$removed" kept="$kept"
