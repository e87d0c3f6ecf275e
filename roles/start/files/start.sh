# shellcheck shell=dash
# Start replicas side by side, then wait until each is ready (roles/start/role.py; the one
# readiness loop, ready.sh). REPLICAS: the replicas (roles/replicas.py's table, read by
# roles/replicas.sh).
UNITS=$(table_field unit "$REPLICAS")
COUNT=$(printf '%s\n' "$UNITS" | grep -c .)
journal() { [ "$COUNT" -gt 1 ] && echo "  | -- $1"; journalctl -u "$1" -n 25 --no-pager -o cat 2>/dev/null | sed 's/^/  | /'; }
for u in $UNITS; do systemctl reset-failed "$u" 2>/dev/null; done
if ! units "$UNITS" start; then
  echo "@start-failed"; for u in $UNITS; do journal "$u"; done; exit "$EXIT_FAILED"
fi
if await_ready "$READY_TIMEOUT_S" "$REPLICAS"; then exit 0; fi
if [ -n "$failed_unit" ]; then journal "$failed_unit"; exit "$EXIT_FAILED"; fi
for u in $UNITS; do journal "$u"; done; exit "$EXIT_TIMEOUT"
