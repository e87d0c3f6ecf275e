# A serving host's own figures for `invoke top` (day2/readings.py: SERVING_HOST): its scrape
# targets (serving/scrape_targets.py writes them at deploy: each replica's labels), each replica
# unit's /metrics on the port its process listens on, its front door's stats page, the GPU
# collector's textfile.
# Parameters: UNIT_GLOBS (blank-separated), FIRST_UNIT, TARGETS (the targets file), STATS_URL,
# GPU_TEXTFILE.
# Result: targets, frontdoor, gpu (each file or page, in base64; empty: none) and replicas
# (each replica unit with a process -> its /metrics, in base64; empty when it did not answer).
b64() { base64 -w0; }
replicas=""
for u in $(replica_units); do
  pid=$(main_pid "$u")
  [ -n "$pid" ] || continue
  port=$(listening_port "$pid")
  [ -n "$port" ] || continue
  metrics=$(curl -sS --max-time 3 "http://127.0.0.1:$port/metrics" 2>/dev/null | b64)
  replicas="$replicas${replicas:+, }\"$u\": \"$metrics\""
done
printf '@result {"targets": "%s", "replicas": {%s}, "frontdoor": "%s", "gpu": "%s"}\n' \
  "$(b64 2>/dev/null < "$TARGETS")" "$replicas" "$(curl -sS --max-time 3 "$STATS_URL" 2>/dev/null | b64)" \
  "$(b64 2>/dev/null < "$GPU_TEXTFILE")"
