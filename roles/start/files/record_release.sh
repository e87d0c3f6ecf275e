# shellcheck shell=dash
# Each replica's release appended to the host's history (serving/releases.py) when it differs
# from the replica's last line there: the image reference and the registry digest the image
# record holds for it, the model, the revision asked for and the commit its ref names in the
# cache. The file is written whole, then renamed; it keeps its newest KEEP_LINES lines.
# Parameters: HISTORY, RECORD (the image record: reference, digest, arch), STATE_DIR, KEEP_LINES,
# RELEASES (a table: unit, image, model, revision, refs: the ref file of the revision).
# Result: recorded (the units whose release was new, blank-separated).
set -e
ref=$(sed -n 1p "$RECORD" 2>/dev/null) || ref=
digest=$(sed -n 2p "$RECORD" 2>/dev/null) || digest=
now=$(date -u +%Y-%m-%dT%H:%M:%SZ)
new=
recorded=
rows=$(printf '%s\n' "$RELEASES" | awk "$ROW_AWK"'{ fields(); print f["unit"], f["image"], f["model"], f["revision"], f["refs"] }')
while read -r unit image model revision refs; do
  [ -n "$unit" ] || continue
  commit=$(cat "$refs" 2>/dev/null) || commit=
  case $revision in
    [0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f][0-9a-f]*) [ -n "$commit" ] || commit=$revision ;;
  esac
  d=
  [ "$ref" != "$image" ] || d=$digest
  line=$(printf '{"unit": "%s", "image": "%s", "digest": "%s", "model": "%s", "revision": "%s", "commit": "%s"' \
    "$unit" "$image" "$d" "$model" "$revision" "$commit")
  last=$(grep -F "{\"unit\": \"$unit\"," "$HISTORY" 2>/dev/null | tail -n 1) || last=
  [ "${last%, \"at\": *}" != "$line" ] || continue
  new="$new$line, \"at\": \"$now\"}
"
  recorded="$recorded${recorded:+ }$unit"
done <<ROWS
$rows
ROWS
if [ -n "$new" ]; then
  mkdir -p "$STATE_DIR"
  tmp=$(mktemp "$HISTORY.XXXXXX")
  { tail -n "$KEEP_LINES" "$HISTORY" 2>/dev/null || true; printf '%s' "$new"; } | tail -n "$KEEP_LINES" > "$tmp"
  chmod 0644 "$tmp"
  mv -f "$tmp" "$HISTORY"
fi
result recorded="$recorded"
