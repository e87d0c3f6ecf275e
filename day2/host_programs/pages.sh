# shellcheck shell=dash
# Pages asked on a host itself, on loopback (day2/readings.py): a gateway's stats page and its
# usage service's /metrics (`invoke status`, `invoke top`), Alertmanager's firing alerts
# (`invoke status`).
# Parameters: PAGES (a line a page: its name, the seconds it may take, its URL).
# Result: each page's name -> {"rc": curl's exit status, "body": what it got, or curl's error, in
# base64}.
found=""
while read -r name seconds url; do
  [ -n "$name" ] || continue
  body=$(curl -sS --max-time "$seconds" "$url" 2>&1)
  rc=$?
  found="$found${found:+, }\"$name\": {\"rc\": $rc, \"body\": \"$(printf '%s' "$body" | base64 -w0)\"}"
done <<PAGES
$PAGES
PAGES
printf '@result {%s}\n' "$found"
