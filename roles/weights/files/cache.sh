# shellcheck shell=dash
# Every model of a Hugging Face cache as the weights role reads it (roles/weights/cache.py):
# its refs, each snapshot's files (and how many point at no blob), its blobs (name, size,
# mtime) and the weights role's record of the blobs it verified (.dgemma-verified).
# Parameters: HUB (the cache's hub folder), VERIFIED (the record's name).
# Markers: @repo DIR, @ref NAME COMMIT, @snapshot COMMIT FILES BROKEN, @blob NAME SIZE MTIME,
# @verified NAME SIZE MTIME (each of the repo before them).
for d in "$HUB"/models--*; do
  [ -d "$d" ] || continue
  echo "@repo ${d##*/}"
  for r in "$d"/refs/*; do
    [ -f "$r" ] && echo "@ref ${r##*/} $(cat "$r")"
  done
  for s in "$d"/snapshots/*; do
    [ -d "$s" ] || continue
    echo "@snapshot ${s##*/} $(find "$s" -type l | wc -l) $(find "$s" -xtype l | wc -l)"
  done
  for f in "$d"/blobs/*; do
    [ -f "$f" ] && echo "@blob $(stat -c '%n %s %Y' "$f" | sed 's|.*/||')"
  done
  [ -f "$d/$VERIFIED" ] && sed 's/^/@verified /' "$d/$VERIFIED"
done
true
