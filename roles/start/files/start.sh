# shellcheck shell=dash
# Start replicas side by side, then wait until each is ready (roles/start/role.py; the one
# readiness loop, ready.sh), and say how it ended in one result line: state ready, start-failed
# (systemctl refused), failed (a unit failed while it started: units, its state in how) or timeout
# (units: those that did not answer); ms, how long the wait took. REPLICAS: the replicas
# (serving/replicas.py's table, read by serving/files/replicas.sh).
UNITS=$(table_field unit "$REPLICAS")
COUNT=$(printf '%s\n' "$UNITS" | grep -c .)
journal() { [ "$COUNT" -gt 1 ] && echo "  | -- $1"; journalctl -u "$1" -n 25 --no-pager -o cat 2>/dev/null | sed 's/^/  | /'; }
for u in $UNITS; do systemctl reset-failed "$u" 2>/dev/null; done
if ! units "$UNITS" start; then
  for u in $UNITS; do journal "$u"; done
  result state=start-failed ms=0 units= how="systemctl start failed"; exit "$EXIT_FAILED"
fi
if await_ready "$READY_TIMEOUT_S" "$REPLICAS"; then result state=ready ms="$waited_ms" units= how=; exit 0; fi
if [ -n "$failed_unit" ]; then
  journal "$failed_unit"
  result state=failed ms="$waited_ms" units="$failed_unit" how="$failed_state"; exit "$EXIT_FAILED"
fi
for u in $UNITS; do journal "$u"; done
result state=timeout ms="$waited_ms" units="$late" how=; exit "$EXIT_TIMEOUT"
