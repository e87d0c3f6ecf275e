# shellcheck shell=dash
# The manifest of a model (download.py: manifest_script, parse_manifest): the hub's answer for
# the revision ($REVISION_URL), the commit it names, then every page of that commit's file tree
# ($TREE_URL then the commit, then each Link rel="next"). Read-only. Its result: revision_status
# (the hub's HTTP status, or error) and revision (the answer, base64); commit (the one the tree
# is read for; blank: none named); tree_status and tree (each page's status and answer in base64,
# blank-separated, in order); why (curl's error, when a status is error).

why=""
# URL FILE: the answer's body into FILE; $code its HTTP status (or error, and why), $next the next page
get() {
  hdr=$(mktemp)
  code=$(auth | hub_curl --max-time 120 -D "$hdr" -o "$2" -w '%{http_code}' "$1" 2>"$hdr.err") \
    || { code=error; why=$(tr '\n' ' ' < "$hdr.err" | cut -c1-200); }
  next=$(sed -n 's/^[Ll]ink: *<\([^>]*\)>; *rel="next".*/\1/p' "$hdr" | tr -d '\r' | tail -n 1)
  rm -f "$hdr" "$hdr.err"
}
rev=$(mktemp) page=$(mktemp) pages=$(mktemp)
trap 'rm -f "$rev" "$page" "$pages"' EXIT
get "$REVISION_URL" "$rev"; revision_status=$code
commit=$(sed -n 's/.*"sha" *: *"\([0-9a-f]\{40\}\)".*/\1/p' "$rev" | head -n 1)
tree_status=""
if [ "$revision_status" = 200 ] && [ -n "$commit" ]; then
  url="$TREE_URL$commit?recursive=true&expand=false"
  n=0
  while [ -n "$url" ] && [ $n -lt 200 ]; do
    : > "$page"; get "$url" "$page"
    tree_status="$tree_status${tree_status:+ }$code"
    { [ $n = 0 ] || printf ' '; base64 -w0 < "$page"; } >> "$pages"
    [ "$code" = 200 ] || break
    url=$next; n=$((n + 1))
  done
fi
result revision_status="$revision_status" revision="$(base64 -w0 < "$rev")" commit="$commit" \
  tree_status="$tree_status" tree="$(cat "$pages")" why="$why"
