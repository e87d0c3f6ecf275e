# shellcheck shell=dash
# Prometheus asked on the monitoring host itself (it listens on loopback only) every query of
# `invoke top` at one instant, then the alerts it evaluates (day2/top.py: PROMETHEUS).
# Parameters: URL (Prometheus), AT (the instant, unix seconds), QUERIES (a line a query: its
# name, a word, then the query in base64).
# Result: answers (each query's name -> Prometheus's answer, in base64), alerts (its answer,
# in base64).
answers=""
while read -r name query; do
  [ -n "$name" ] || continue
  answer=$(curl -sS --max-time 5 -G --data-urlencode "query=$(printf '%s' "$query" | base64 -d)" \
           --data-urlencode "time=$AT" "$URL/api/v1/query" 2>&1 | base64 -w0)
  answers="$answers${answers:+, }\"$name\": \"$answer\""
done <<QUERIES
$QUERIES
QUERIES
alerts=$(curl -sS --max-time 5 "$URL/api/v1/alerts" 2>&1 | base64 -w0)
printf '@result {"answers": {%s}, "alerts": "%s"}\n' "$answers" "$alerts"
