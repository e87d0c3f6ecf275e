# shellcheck shell=dash
# The gateway's usage service told to start or restart (`act`), then waited for until it has
# bound its socket again (HAProxy sends it every request's record there). Parameters: UNIT,
# SOCKET, TIMEOUT_S.

act
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
