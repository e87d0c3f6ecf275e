# Each vLLM replica of a serving host as `invoke status` reads it (day2/readings.py: REPLICAS):
# the state of every container the runtime has, by name (serving/replicas.py tells which replica
# each name is), and for each replica unit the command line its process runs now (the settings
# in force, not the file's), its /health and its load (vLLM's own gauges), asked on the port that
# command line names. No replica's name or port is made here.
# Parameters: RUNTIME, UNIT_GLOBS (blank-separated), FIRST_UNIT.
# Result: containers (the runtime's "NAME STATE" lines, in base64; a docker NAME starts with "/") and units (each unit -> its
# "argv" (its NUL-separated words in base64; empty: no process), "health" (/health's HTTP
# status; empty: not asked), "load" ("running,waiting,kv-cache"; empty: no answer) and "denoising"
# (a diffusion model's counters since it started: "steps,canvas-positions,committed-tokens"; empty:
# none exported)).
found=""
for u in $(replica_units); do
  argv="" health="" load="" denoising=""
  pid=$(main_pid "$u")
  if [ -n "$pid" ]; then
    argv=$(base64 -w0 "/proc/$pid/cmdline")
    port=$(listening_port "$pid")
    if [ -n "$port" ]; then
      health=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "http://127.0.0.1:$port/health" 2>/dev/null)
      # vLLM's gauges: requests running and waiting, KV cache
      metrics=$(curl -s --max-time 5 "http://127.0.0.1:$port/metrics" 2>/dev/null)
      load=$(printf '%s\n' "$metrics" | awk '
        /^vllm:num_requests_running[{ ]/ { r += $NF } /^vllm:num_requests_waiting[{ ]/ { w += $NF }
        /^vllm:kv_cache_usage_perc[{ ]/ { k = $NF; seen = 1 }
        END { if (seen) printf "%g,%g,%g", r, w, k }')
      # a diffusion model's work so far (vllm/v1/spec_decode/metrics.py), summed over its engines
      denoising=$(printf '%s\n' "$metrics" | awk '
        /^vllm:diffusion_num_denoising_steps_total[{ ]/ { s += $NF; seen = 1 }
        /^vllm:diffusion_num_canvas_positions_total[{ ]/ { p += $NF }
        /^vllm:diffusion_num_committed_tokens_total[{ ]/ { c += $NF }
        END { if (seen) printf "%.0f,%.0f,%.0f", s, p, c }')
    fi
  fi
  found="$found${found:+, }\"$u\": {\"argv\": \"$argv\", \"health\": \"$health\", \"load\": \"$load\", \"denoising\": \"$denoising\"}"
done
# every container's state as inspect says it (running, exited, created...); docker's names start
# with "/". docker's ps says that state itself (its .State, since 20.10): one program, not two (the
# docker CLI costs a second of CPU under emulation, as on the lab's spark01); podman 4.3's ps says
# words there ("Up 8 seconds ago"), and an older docker's has no .State: their containers are inspected
if [ "$RUNTIME" = docker ] && states=$(docker ps -a --format '/{{.Names}} {{.State}}' 2>/dev/null); then
  :
else
  states=$("$RUNTIME" ps -aq 2>/dev/null | xargs -r "$RUNTIME" inspect --format '{{.Name}} {{.State.Status}}' 2>/dev/null)
fi
containers=$(printf '%s' "$states" | base64 -w0)
printf '@result {"containers": "%s", "units": {%s}}\n' "$containers" "$found"
