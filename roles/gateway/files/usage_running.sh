# shellcheck shell=dash
# After systemd.sh: the gateway's usage service, started or restarted (ACTION; none: enabled alone,
# not waited for), waited for until it has bound its socket again (HAProxy sends it every request's
# record there). Parameters: UNIT, ACTION, SOCKET, TIMEOUT_S.

[ "$ACTION" != none ] || exit 0
start=$(date +%s)
while :; do
  elapsed=$(( $(date +%s) - start ))
  state=$(systemctl is-active "$UNIT")
  if [ "$state" = failed ]; then
    echo "@failed $state after $elapsed s"
    journalctl -u "$UNIT" -n 15 --no-pager -o cat 2>/dev/null | grep -v '^{' | sed 's/^/  | /'
    exit "$EXIT_FAILED"
  fi
  if [ "$state" = active ] && [ -S "$SOCKET" ] && [ "$(stat -c %Y "$SOCKET")" -ge "$start" ]; then
    echo "@ready $elapsed"; exit 0
  fi
  if [ "$elapsed" -ge "$TIMEOUT_S" ]; then
    echo "@timeout $elapsed $state"; exit "$EXIT_TIMEOUT"
  fi
  sleep 0.2
done
