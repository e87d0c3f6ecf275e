# shellcheck shell=dash
# After systemd.sh: the metrics collector, started or restarted (ACTION; none: enabled alone, not
# waited for), waited for until it has written its textfile (TEXTFILE newer than this start).
# Parameters: UNIT, ACTION, TEXTFILE, TIMEOUT_S. Exit codes: EXIT_FAILED (its unit failed: its last
# log lines follow), EXIT_TIMEOUT.
[ "$ACTION" != none ] || exit 0
began=$(date +%s)
while :; do
  if [ -f "$TEXTFILE" ] && [ "$(stat -c %Y "$TEXTFILE")" -ge "$began" ]; then echo "@ready $(( $(date +%s) - began ))"; exit 0; fi
  if [ "$(systemctl is-active "$UNIT")" = failed ]; then
    echo "@failed"; journalctl -u "$UNIT" -n 10 --no-pager -o cat | sed 's/^/  | /'; exit "$EXIT_FAILED"
  fi
  if [ $(( $(date +%s) - began )) -ge "$TIMEOUT_S" ]; then echo "@timeout $TIMEOUT_S"; exit "$EXIT_TIMEOUT"; fi
  sleep 0.5
done
