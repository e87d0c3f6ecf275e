# shellcheck shell=dash
# After systemd.sh: the metrics collector, started or restarted (ACTION; none: enabled alone, not
# waited for), waited for until it has written its textfile (TEXTFILE newer than this start).
# Its result: state (ready; failed: its unit failed, its last log lines before; timeout) and
# seconds. Parameters: UNIT, ACTION, TEXTFILE, TIMEOUT_S. Exit codes: EXIT_FAILED, EXIT_TIMEOUT.
[ "$ACTION" != none ] || exit 0
began=$acted_at
while :; do
  elapsed=$(( $(date +%s) - began ))
  if [ -f "$TEXTFILE" ] && [ "$(stat -c %Y "$TEXTFILE")" -ge "$began" ]; then result state=ready seconds="$elapsed"; exit 0; fi
  if [ "$(systemctl is-active "$UNIT")" = failed ]; then
    journalctl -u "$UNIT" -n 10 --no-pager -o cat | sed 's/^/  | /'
    result state=failed seconds="$elapsed"; exit "$EXIT_FAILED"
  fi
  if [ "$elapsed" -ge "$TIMEOUT_S" ]; then result state=timeout seconds="$elapsed"; exit "$EXIT_TIMEOUT"; fi
  sleep 0.5
done
