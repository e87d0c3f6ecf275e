# shellcheck shell=dash
# After systemd.sh (enabled at boot, then started, restarted or reloaded: ACTION; none: enabled
# alone, not waited for): a container of ours beside vLLM (serving/container_unit), waited for until
# it answers: READY_URL answers (none: at once) and, for a program that reads its files again on a
# signal (RELOADED: prometheus, alertmanager), its last (re)load since the action began succeeded,
# as its own metrics at METRICS_URL say. Its result: state (ready, failed: its unit failed, or
# timeout) and seconds, its last log lines before it when it did not answer.
# Parameters: UNIT, ACTION, READY_URL, RELOADED, METRICS_URL, TIMEOUT_S. Exit codes: EXIT_FAILED,
# EXIT_TIMEOUT.
journal() { journalctl -u "$UNIT" -n 15 --no-pager -o cat | sed 's/^/  | /'; }
ready() {
  [ -z "$READY_URL" ] && return 0
  curl -sf -o /dev/null --max-time 2 "$READY_URL" || return 1
  [ -z "$RELOADED" ] && return 0
  curl -s --max-time 2 "$METRICS_URL" | awk -v began="$began" -v p="$RELOADED" '
    $1 == p "_config_last_reload_successful" { ok = $2 }
    $1 == p "_config_last_reload_success_timestamp_seconds" { at = $2 }
    END { exit !(ok == 1 && at + 0 >= began + 0) }'
}
[ "$ACTION" != none ] || exit 0
began=$acted_at
start=$(date +%s)
while :; do
  elapsed=$(( $(date +%s) - start ))
  if [ "$(systemctl is-active "$UNIT")" = failed ]; then journal; result state=failed seconds="$elapsed"; exit "$EXIT_FAILED"; fi
  if ready >/dev/null 2>&1; then result state=ready seconds="$elapsed"; exit 0; fi
  if [ "$elapsed" -ge "$TIMEOUT_S" ]; then journal; result state=timeout seconds="$elapsed"; exit "$EXIT_TIMEOUT"; fi
  sleep 0.5
done
