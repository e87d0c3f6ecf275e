# shellcheck shell=dash
# What a role left on a host that is no longer in its group (serving/gateway_leftovers.py,
# serving/monitoring_leftovers.py): its units stopped and disabled, their files and the role's
# folders (its keys) removed, and, for a gateway, the host's share of the shared address given up
# when keepalived's configuration is ours (one that is not ours is left alone). Parameters: UNITS
# (a line each), FILES (a line each), FOLDERS (a line each), SHARED_UNIT, SHARED_CONF,
# SHARED_CHECK (empty: no shared address to give up), OURS (what the first line of ours holds).
printf '%s\n' "$UNITS" | while IFS= read -r unit; do
  [ -z "$unit" ] || systemctl disable --now "$unit" 2>/dev/null
done
printf '%s\n' "$FILES" | while IFS= read -r path; do [ -z "$path" ] || rm -f "$path"; done
printf '%s\n' "$FOLDERS" | while IFS= read -r path; do [ -z "$path" ] || rm -rf "$path"; done
if [ -n "$SHARED_CONF" ] && grep -qsF "$OURS" "$SHARED_CONF"; then
  systemctl disable --now "$SHARED_UNIT" 2>/dev/null
  rm -f "$SHARED_CONF" "$SHARED_CHECK"
fi
systemctl daemon-reload
# a unit stopped with an error (a container's stop) stays listed as failed until reset
printf '%s\n' "$UNITS" | while IFS= read -r unit; do
  [ -z "$unit" ] || systemctl reset-failed "$unit" 2>/dev/null
done
true
