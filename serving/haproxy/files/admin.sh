# shellcheck shell=dash
# The front door's admin actions (serving/haproxy/admin.py), for scripts that run on the host
# as root: its stats page with admin actions at $ADMIN (a unix socket only root reaches).
# $S names the replica's server (serving/replicas.py); $ROLLING_BACKEND and $ROLLING_SERVER
# the roll's flag, $POOL_PREFIX the pools' backends; $RUNTIME its runtime API (root only);
# $GATEWAY_SEES_FLAG_S and $GATEWAY_SAW_MARGIN_S (gateways_see).

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
# the gateways' checks of the pools $1 ("a b") counted here, "address@pool count" a line (the
# front door's checks_seen table, through its runtime API: curl speaks telnet to the unix socket)
checks_seen() { echo 'show table checks_seen' | curl -sS --max-time 5 --unix-socket "$RUNTIME" telnet://localhost 2>/dev/null \
  | awk -v pools=" $1 " '{ k = ""; n = ""
      for (i = 2; i <= NF; i++) { if (index($i, "key=") == 1) k = substr($i, 5); if (index($i, "http_req_cnt=") == 1) n = substr($i, 14) } }
    k != "" && n != "" { p = k; sub(/^.*@/, "", p); if (index(pools, " " p " ")) print k, n }'; }
# once the pools $1 have their flags up: wait until every gateway that checks here has checked each
# of them once more (a check counted now saw the flag), then GATEWAY_SAW_MARGIN_S for its answer to
# arrive; GATEWAY_SEES_FLAG_S at most (a gateway that stopped checking, none seen at all). Says
# "seen MS" or "waited MS"
gateways_see() {
  since=$(now_ms); most=$(awk -v s="$GATEWAY_SEES_FLAG_S" 'BEGIN { print int(s * 1000) }')
  was=$(checks_seen "$1")
  while [ -n "$was" ] && [ $(( $(now_ms) - since )) -lt "$most" ]; do
    sleep 0.1
    if checks_seen "$1" | awk -v was="$was" '
        BEGIN { n = split(was, line, "\n"); for (i = 1; i <= n; i++) { split(line[i], f, " "); before[f[1]] = f[2] + 0 } }
        ($1 in before) && $2 + 0 > before[$1] { moved[$1] = 1 }
        END { for (k in before) if (!(k in moved)) exit 1 }'; then
      sleep "$GATEWAY_SAW_MARGIN_S"; echo "seen $(( $(now_ms) - since ))"; return 0
    fi
  done
  left=$(( most - ($(now_ms) - since) ))
  if [ "$left" -gt 0 ]; then sleep "$(awk -v ms="$left" 'BEGIN { printf "%.3f", ms / 1000 }')"; fi
  echo "waited $(( $(now_ms) - since ))"
}
