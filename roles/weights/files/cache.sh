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
  # a program per snapshot and one for all its blobs, not four and two per blob: each start
  # takes a tenth of a second of CPU on an emulated host (the lab's spark01: 2 s a gathering)
  for s in "$d"/snapshots/*; do
    [ -d "$s" ] || continue
    links=0
    broken=0
    # each symbolic link: "x" when it points at nothing (-xtype l), "l" when at a file
    # shellcheck disable=SC2044 # find prints only the letters x and l, never a name
    for k in $(find "$s" -type l \( -xtype l -printf 'x ' -o -printf 'l ' \)); do
      links=$((links + 1))
      [ "$k" = l ] || broken=$((broken + 1))
    done
    echo "@snapshot ${s##*/} $links $broken"
  done
  set --
  for f in "$d"/blobs/*; do
    [ -f "$f" ] && set -- "$@" "$f"
  done
  [ $# -eq 0 ] || stat -c '%n %s %Y' -- "$@" | sed 's|.*/||; s/^/@blob /'
  [ -f "$d/$VERIFIED" ] && sed 's/^/@verified /' "$d/$VERIFIED"
done
true
