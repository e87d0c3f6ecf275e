# shellcheck shell=dash
# Start replicas side by side, then wait until each is ready (roles/start/role.py; the one
# readiness loop, ready.sh). REPLICAS: the replicas (roles/replicas.py: index unit container
# port server gpus, a line each).
UNITS=$(printf '%s\n' "$REPLICAS" | awk 'NF { print $2 }')
COUNT=$(printf '%s\n' "$REPLICAS" | awk 'NF { n++ } END { print n + 0 }')
journal() { [ "$COUNT" -gt 1 ] && echo "  | -- $1"; journalctl -u "$1" -n 25 --no-pager -o cat 2>/dev/null | sed 's/^/  | /'; }
for u in $UNITS; do systemctl reset-failed "$u" 2>/dev/null; done
# shellcheck disable=SC2086 # unit names, one word each
if ! systemctl start $UNITS; then
  echo "@start-failed"; for u in $UNITS; do journal "$u"; done; exit "$EXIT_FAILED"
fi
# shellcheck disable=SC2046 # one UNIT=PORT word each
if await_ready "$READY_TIMEOUT_S" $(printf '%s\n' "$REPLICAS" | awk 'NF { print $2 "=" $4 }'); then exit 0; fi
if [ -n "$failed_unit" ]; then journal "$failed_unit"; exit "$EXIT_FAILED"; fi
for u in $UNITS; do journal "$u"; done; exit "$EXIT_TIMEOUT"
