# shellcheck shell=dash
# The alerts Alertmanager holds as firing, asked on the monitoring host itself (it listens on
# loopback only) for `invoke status` (day2/readings.py: ALERTS). Parameters: URL (its
# /api/v2/alerts with the query). Result: rc (curl's exit status), body (Alertmanager's
# answer, or curl's error, in base64).
body=$(curl -sS --max-time 5 "$URL" 2>&1)
rc=$?
printf '@result {"rc": %d, "body": "%s"}\n' "$rc" "$(printf '%s' "$body" | base64 -w0)"
