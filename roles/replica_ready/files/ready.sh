# shellcheck shell=dash
# The one readiness loop (roles/replica_ready/__init__.py): a replica is ready when vLLM's own /health
# answers, then /v1/models answers the key, on its loopback port. A unit that fails, goes
# inactive, or that systemd restarts (its container exited) fails the wait at once.
#
# await_ready TIMEOUT_S TABLE: every replica of the table (roles/replicas.sh) on its port; says
# @replica-ready UNIT MS as each answers, then @ready MS; or @failed UNIT STATE MS / @timeout MS
# UNIT..., sets $why and $failed_unit, and returns 1
await_ready() {
  # shellcheck disable=SC2034 # why and failed_unit are what it tells the program that includes it
  limit=$1; t0=$(now_ms); why=""; failed_unit=""; pending=""
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
        # shellcheck disable=SC2034
        failed_unit=$u; why="its container exited after $(( ms / 1000 )) s ($active/$sub)"
        say "@failed $u $active/$sub $ms"; return 1
      fi
      if curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$port/health" 2>/dev/null &&
         auth | curl -fsS --max-time 5 -K - -o /dev/null "http://127.0.0.1:$port/v1/models" 2>/dev/null; then
        say "@replica-ready $u $ms"
      else
        left="$left $e"
      fi
    done
    pending=$left
    if [ -z "$pending" ]; then say "@ready $(( $(now_ms) - t0 ))"; return 0; fi
    if [ "$ms" -ge $(( limit * 1000 )) ]; then
      # shellcheck disable=SC2034
      why="no answer on /health and /v1/models within $limit s"
      say "@timeout $ms$(for e in $pending; do printf ' %s' "${e%%=*}"; done)"; return 1
    fi
    sleep 0.3
  done
}
