# shellcheck shell=dash
# After systemd.sh: the gateway's usage service, started or restarted (ACTION; none: enabled alone,
# not waited for), waited for until it has bound its socket again (HAProxy sends it every request's
# record there). Its result: state (ready; failed: its unit failed, its last log lines before;
# timeout), seconds, the unit's state. Parameters: UNIT, ACTION, SOCKET, TIMEOUT_S.

[ "$ACTION" != none ] || exit 0
start=$(date +%s)
while :; do
  elapsed=$(( $(date +%s) - start ))
  state=$(systemctl is-active "$UNIT")
  if [ "$state" = failed ]; then
    journalctl -u "$UNIT" -n 15 --no-pager -o cat 2>/dev/null | grep -v '^{' | sed 's/^/  | /'
    result state=failed seconds="$elapsed" unit_state="$state"
    exit "$EXIT_FAILED"
  fi
  # its socket bound since the action began (a socket older than that is the process before)
  if [ "$state" = active ] && [ -S "$SOCKET" ] && [ "$(stat -c %Y "$SOCKET")" -ge "$acted_at" ]; then
    result state=ready seconds="$elapsed" unit_state="$state"; exit 0
  fi
  if [ "$elapsed" -ge "$TIMEOUT_S" ]; then
    result state=timeout seconds="$elapsed" unit_state="$state"; exit "$EXIT_TIMEOUT"
  fi
  sleep 0.2
done
