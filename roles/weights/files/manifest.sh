# shellcheck shell=dash
# The manifest of a model (download.py: manifest_script, parse_manifest): the hub's answer for
# the revision ($REVISION_URL), the commit it names, then every page of that commit's file tree
# ($TREE_URL then the commit, then each Link rel="next"). Each answer is @revision or @tree, then
# @status CODE, its body and @end; @commit SHA between them. Read-only.

# URL [FILE]: @status CODE, the body, @end (the body kept in FILE when given); $next: the next page
get() {
  body=${2:-$(mktemp)}; hdr=$(mktemp)
  code=$(auth | hub_curl --max-time 120 -D "$hdr" -o "$body" -w '%{http_code}' "$1" 2>"$hdr.err") \
    || code="error $(tr '\n' ' ' < "$hdr.err" | cut -c1-200)"
  printf '@status %s\n' "$code"; cat "$body"; printf '\n@end\n'
  next=$(sed -n 's/^[Ll]ink: *<\([^>]*\)>; *rel="next".*/\1/p' "$hdr" | tr -d '\r' | tail -n 1)
  rm -f "$hdr" "$hdr.err"; [ -n "${2:-}" ] || rm -f "$body"
}
rev=$(mktemp)
printf '@revision\n'; get "$REVISION_URL" "$rev"
commit=$(sed -n 's/.*"sha" *: *"\([0-9a-f]\{40\}\)".*/\1/p' "$rev" | head -n 1); rm -f "$rev"
[ -n "$commit" ] || exit 0
printf '@commit %s\n' "$commit"
url="$TREE_URL$commit?recursive=true&expand=false"
pages=0
while [ -n "$url" ] && [ $pages -lt 200 ]; do
  printf '@tree\n'; get "$url"; url=$next; pages=$((pages + 1))
done
