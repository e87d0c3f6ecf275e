# shellcheck shell=dash
# Replicas a roll cut short left drained in the front door (a reboot or SIGKILL of its
# program, which otherwise puts them back itself), back in service, and the roll's flags
# lowered (roles/frontdoor/role.py). SERVERS: their servers, blank-separated. Each is tried,
# whatever the others did; the result says which the front door refused: refused (servers)
# and flags_refused (flags it would not lower).
in_service=""; refused=""; flags_refused=""
for S in $SERVERS; do
  if admin ready; then in_service="$in_service $S"; else refused="$refused $S"; fi
done
flag maint || flags_refused="$ROLLING_SERVER"
for p in $(raised_pool_flags); do pool_flag "$p" maint || flags_refused="$flags_refused ${ROLLING_SERVER}_$p"; done
result in_service="${in_service# }" refused="${refused# }" flags_refused="${flags_refused# }"
[ -z "$refused$flags_refused" ] || exit "$EXIT_REFUSED"
