# shellcheck shell=dash
# The one readiness loop (serving/replica_ready/__init__.py): a replica is ready when vLLM's own /health
# answers, then /v1/models answers the key, on its loopback port. A unit that fails, goes
# inactive, or that systemd restarts (its container exited) fails the wait at once.
#
# await_ready TIMEOUT_S TABLE: every replica of the table (serving/files/replicas.sh) on its port; says
# @replica-ready UNIT MS as each answers. How the wait ended is the including program's to say (its
# result, or its own markers), from what this sets: waited_ms (how long it took), and when it returns
# 1, why, with failed_unit and failed_state (a unit that failed: its ActiveState/SubState) or late
# (the units that did not answer in time)
# shellcheck disable=SC2034 # what it sets is what it tells the program that includes it
await_ready() {
  limit=$1; t0=$(now_ms); why=""; failed_unit=""; failed_state=""; late=""; waited_ms=0; pending=""
  for e in $(table_pairs unit port "$2"); do pending="$pending $e=$(systemctl show -p NRestarts --value "${e%%=*}")"; done
  while :; do
    ms=$(( $(now_ms) - t0 )); left=""
    for e in $pending; do
      u=${e%%=*}; rest=${e#*=}; port=${rest%%=*}; n0=${rest#*=}
      # one systemctl for the three: each is a round trip to systemd, and this loop polls
      active=""; sub=""; n=""
      while IFS='=' read -r k v; do
        case $k in ActiveState) active=$v;; SubState) sub=$v;; NRestarts) n=$v;; esac
      done <<UNIT_STATE
$(systemctl show -p ActiveState -p SubState -p NRestarts "$u")
UNIT_STATE
      if [ "$active" = failed ] || [ "$active" = inactive ] || [ "$sub" = auto-restart ] || [ "$n" != "$n0" ]; then
        failed_unit=$u; failed_state=$active/$sub; waited_ms=$ms
        why="its container exited after $(( ms / 1000 )) s ($active/$sub)"; return 1
      fi
      if curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$port/health" 2>/dev/null &&
         auth | curl -fsS --max-time 5 -K - -o /dev/null "http://127.0.0.1:$port/v1/models" 2>/dev/null; then
        say "@replica-ready $u $ms"
      else
        left="$left $e"
      fi
    done
    pending=$left
    if [ -z "$pending" ]; then waited_ms=$(( $(now_ms) - t0 )); return 0; fi
    if [ "$ms" -ge $(( limit * 1000 )) ]; then
      why="no answer on /health and /v1/models within $limit s"; waited_ms=$ms
      late=$(for e in $pending; do printf '%s ' "${e%%=*}"; done); late=${late% }; return 1
    fi
    sleep 0.3
  done
}
