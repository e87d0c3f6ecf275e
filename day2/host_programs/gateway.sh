# shellcheck shell=dash
# A gateway as `invoke status` and `invoke top` read it (day2/readings.py: GATEWAY): its stats
# page (HAProxy's CSV: each pool's front doors and their states) and its usage service's
# /metrics (the counts per key), each on loopback. Parameters: STATS_URL, USAGE_URL.
# Result: stats_rc and usage_rc (curl's exit status), stats and usage (what it got, or its
# error, in base64).
stats=$(curl -sS --max-time 5 "$STATS_URL" 2>&1)
stats_rc=$?
usage=$(curl -sS --max-time 3 "$USAGE_URL" 2>&1)
usage_rc=$?
printf '@result {"stats_rc": %d, "stats": "%s", "usage_rc": %d, "usage": "%s"}\n' \
  "$stats_rc" "$(printf '%s' "$stats" | base64 -w0)" "$usage_rc" "$(printf '%s' "$usage" | base64 -w0)"
