# shellcheck shell=dash
# Before systemd.sh restarts a gateway that holds the gateways' shared address (serving/haproxy/steps.py):
# the address goes to another gateway first (keepalived stopped here tells the others at once), so
# that new requests reach that one while this HAProxy restarts, where without it they would be
# refused until keepalived's check gave the address up (about 2 s). A request in flight at the move
# loses its connection, as at any move of the address (the client's next packets reach the other
# gateway), and the client retries it. keepalived starts again when this program ends, and this
# gateway is a backup from then on (unless gateway_preempt). With no other gateway answering at the
# address within 10 s, the restart goes on: what it would have cost with no handoff.
# Parameters: ACTION, SHARED_ADDRESS (empty: nothing to hand off), SHARED_URL (https /health there),
# KEEPALIVED (its unit), CA_FILE.
handed_off=0
take_part_again() { if [ "$handed_off" = 1 ]; then systemctl start "$KEEPALIVED"; fi; }
held_here() { ip -o addr show | grep -qF " $SHARED_ADDRESS/"; }
if [ "$ACTION" = restart ] && [ -n "$SHARED_ADDRESS" ] && systemctl is-active -q "$KEEPALIVED" && held_here; then
  handed_off=1
  trap take_part_again EXIT
  systemctl stop "$KEEPALIVED"
  tries=0
  while [ "$tries" -lt 33 ]; do
    if ! held_here && curl -sS -o /dev/null --max-time 1 --cacert "$CA_FILE" "$SHARED_URL" 2>/dev/null; then
      echo "@handed-off $SHARED_ADDRESS"
      break
    fi
    sleep 0.3
    tries=$((tries + 1))
  done
fi
