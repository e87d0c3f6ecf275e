# shellcheck shell=dash
# The front door's admin actions (roles/haproxy/admin.py), for scripts that run on the host
# as root: its stats page with admin actions at $ADMIN (a unix socket only root reaches).
# $S names the replica's server (roles/replicas.py); $ROLLING_BACKEND and $ROLLING_SERVER
# the roll's flag, $POOL_PREFIX the pools' backends.

# an admin action on one server: $1 its backend, $2 its name, $3 the action (HAProxy's stats
# page answers a POST with a redirect ending in ;st=DONE)
admin_action() { curl -sS --max-time 5 --unix-socket "$ADMIN" -D - -o /dev/null --data "s=$2&b=$1&action=$3" \
  http://frontdoor/ 2>/dev/null | grep -q 'st=DONE'; }
# the stats page as CSV (pxname $1, svname $2, qcur $3, scur $5, status $18...)
stats_csv() { curl -sS --max-time 5 --unix-socket "$ADMIN" 'http://frontdoor/;csv' 2>/dev/null; }
# drain, ready, hrunn, maint: the replica whose server is $S
admin() { admin_action servers "$S" "$1"; }
# the host's rolling flag: ready (raised) or maint (lowered); a front door without it says no
flag() { admin_action "$ROLLING_BACKEND" "$ROLLING_SERVER" "$1"; }
# a pool's flag (<flag>_<family> in the rolling backend): ready (raised: the gateway takes this
# host out for that family, /health says 404 for it) or maint (lowered)
pool_flag() { admin_action "$ROLLING_BACKEND" "${ROLLING_SERVER}_$1" "$2"; }
# the pools ($1: " replica0 replica3 ", servers) with no server in service but these: the roll
# takes their last ones, so the gateway must stop sending that family here before they drain
leaving_pools() { stats_csv | awk -F, -v servers="$1" -v prefix="$POOL_PREFIX" '
    index($1, prefix) != 1 || $2 == "FRONTEND" || $2 == "BACKEND" { next }
    { p = substr($1, length(prefix) + 1) }
    index(servers, " " $2 " ") { mine[p] = 1; next }
    $18 == "UP" { other[p] = 1 }
    END { for (p in mine) if (!(p in other)) print p }'; }
# the pools whose flag is up (a roll cut short left it so)
raised_pool_flags() { stats_csv | awk -F, -v backend="$ROLLING_BACKEND" -v flag="${ROLLING_SERVER}_" '
    $1 == backend && index($2, flag) == 1 && $18 !~ /^MAINT/ { print substr($2, length(flag) + 1) }'; }
# requests queued or in flight at $S (through its pool too: a family's requests go by its pool,
# whose server tracks this one), and its state (UP, DRAIN, DOWN, MAINT...)
fd_state() { stats_csv | awk -F, -v s="$S" -v prefix="$POOL_PREFIX" '
    $2 == s && ($1 == "servers" || index($1, prefix) == 1) { n += $3 + $5 }
    $1 == "servers" && $2 == s { state = $18 }
    END { if (state != "") print n, state }'; }
