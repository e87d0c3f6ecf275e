# shellcheck shell=dash
# A container's unit enabled at boot, then started, restarted or reloaded (ACTION; none: enabled
# alone), and waited for until it answers (roles/container_unit): READY_URL answers (none: at
# once) and, for a program that reads its files again on a signal (RELOADED: prometheus,
# alertmanager), its last (re)load since this began succeeded, as its own metrics at
# METRICS_URL say.
# Parameters: UNIT, ACTION (start, restart, reload or none), READY_URL, RELOADED, METRICS_URL,
# TIMEOUT_S. Exit codes: EXIT_FAILED (its unit failed), EXIT_TIMEOUT; each with its last log lines.
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
systemctl enable "$UNIT" 2>/dev/null
began=$(date +%s)
case $ACTION in
  start) systemctl daemon-reload; systemctl reset-failed "$UNIT" 2>/dev/null; systemctl start "$UNIT" ;;
  restart) systemctl daemon-reload; systemctl restart "$UNIT" ;;
  reload) systemctl reload "$UNIT" ;;
  none) exit 0 ;;
esac
start=$(date +%s)
while :; do
  elapsed=$(( $(date +%s) - start ))
  if [ "$(systemctl is-active "$UNIT")" = failed ]; then echo "@failed after $elapsed s"; journal; exit "$EXIT_FAILED"; fi
  if ready >/dev/null 2>&1; then echo "@ready $elapsed"; exit 0; fi
  if [ "$elapsed" -ge "$TIMEOUT_S" ]; then echo "@timeout $elapsed"; journal; exit "$EXIT_TIMEOUT"; fi
  sleep 0.5
done
