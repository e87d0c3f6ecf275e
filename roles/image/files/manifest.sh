# shellcheck shell=dash
# An image's manifest, asked of its registry as a pull asks it (the Registry HTTP API: GET
# /v2/REPOSITORY/manifests/REFERENCE, the index and manifest types accepted), so that the image
# role knows how much a pull will write before it starts. https first, then plain http (a lab's or
# a mirror's registry); a 401 that names a Bearer realm is answered with the anonymous token the
# realm gives (Docker Hub's way), which reaches curl in its config on stdin, never in its argv.
# Parameters: REGISTRY (host[:port]), REPOSITORY, REFERENCE (a tag or a digest).
# Result: status (the registry's HTTP status; error: no answer), type (its Content-Type), body
# (base64), why (curl's error).
tmp=$(mktemp -d) || { result status=error type= body= why="mktemp failed"; exit 0; }
trap 'rm -rf "$tmp"' EXIT
accept='application/vnd.oci.image.index.v1+json, application/vnd.docker.distribution.manifest.list.v2+json, application/vnd.oci.image.manifest.v1+json, application/vnd.docker.distribution.manifest.v2+json'
ask() {
  { printf 'header = "Accept: %s"\n' "$accept"
    [ -z "${token:-}" ] || printf 'header = "Authorization: Bearer %s"\n' "$token"
  } | curl -sS --max-time 30 -K - -o "$tmp/body" -D "$tmp/head" -w '%{http_code}' "$1" 2>"$tmp/err"
}
token=
status=error
for scheme in https http; do
  url="$scheme://$REGISTRY/v2/$REPOSITORY/manifests/$REFERENCE"
  if status=$(ask "$url"); then break; fi
  status=error
done
if [ "$status" = 401 ]; then
  challenge=$(tr -d '\r' < "$tmp/head" | sed -n 's/^[Ww][Ww][Ww]-[Aa]uthenticate: *Bearer //p' | head -n 1)
  realm=$(printf '%s' "$challenge" | sed -n 's/.*realm="\([^"]*\)".*/\1/p')
  service=$(printf '%s' "$challenge" | sed -n 's/.*service="\([^"]*\)".*/\1/p')
  scope=$(printf '%s' "$challenge" | sed -n 's/.*scope="\([^"]*\)".*/\1/p')
  if [ -n "$realm" ]; then
    token=$(curl -sS --max-time 30 -G --data-urlencode "service=$service" --data-urlencode "scope=$scope" "$realm" \
              2>>"$tmp/err" | sed -n 's/.*"token" *: *"\([^"]*\)".*/\1/p')
    [ -z "$token" ] || status=$(ask "$url") || status=error
  fi
fi
type=$(tr -d '\r' < "$tmp/head" 2>/dev/null | sed -n 's/^[Cc]ontent-[Tt]ype: *//p' | tail -n 1)
result status="$status" type="$type" body="$(base64 < "$tmp/body" 2>/dev/null | tr -d '\n')" why="$(tail -n 1 "$tmp/err")"
