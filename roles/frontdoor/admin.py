"""The front door's admin actions as shell, for scripts that run on the host as root:
drain a replica, put it back, say it is up (its stats page with admin actions, over a
unix socket only root reaches), read a replica's state, and raise or lower the host's
"rolling" flag.

The flag is a server of its own (backend ``rolling``, no checks, in maintenance until
raised). While it is up and no replica is in service, the front door answers /health
with 404, so the gateway keeps the host out of balancing (DRAIN, ``disable-on-404``)
for the whole roll, also once the replica has stopped, instead of seeing it DOWN."""
from __future__ import annotations

from .render import FRONTDOOR, admin_socket
from .stats import POOL_PREFIX

ADMIN_SOCKET = admin_socket(FRONTDOOR)  # the front door's stats page with admin actions (root only)
FRONTDOOR_CA = f"{FRONTDOOR.dir}/ca.crt"
ROLLING_BACKEND, ROLLING_SERVER = "rolling", "flag"

# replica $I in the front door whose stats page with admin actions is at $ADMIN
FRONTDOOR_SHELL = rf"""
# an admin action on one server: $1 its backend, $2 its name, $3 the action (HAProxy's stats
# page answers a POST with a redirect ending in ;st=DONE)
admin_action() {{ curl -sS --max-time 5 --unix-socket "$ADMIN" -D - -o /dev/null --data "s=$2&b=$1&action=$3" \
  http://frontdoor/ 2>/dev/null | grep -q 'st=DONE'; }}
# the stats page as CSV (pxname, svname, qcur $3, scur $5, status $18...)
stats_csv() {{ curl -sS --max-time 5 --unix-socket "$ADMIN" 'http://frontdoor/;csv' 2>/dev/null; }}
# drain, ready, hrunn, maint
admin() {{ admin_action servers "replica$I" "$1"; }}
# the host's rolling flag: ready (raised) or maint (lowered); a front door without it says no
flag() {{ admin_action {ROLLING_BACKEND} {ROLLING_SERVER} "$1"; }}
# a pool's flag (flag_<family> in backend rolling): ready (raised: the gateway takes this host out
# for that family, /health says 404 for it) or maint (lowered)
pool_flag() {{ admin_action {ROLLING_BACKEND} "{ROLLING_SERVER}_$1" "$2"; }}
# the pools ($1: " 0 3 ", replica indices) with no replica in service but these: the roll takes
# their last ones, so the gateway must stop sending that family here before they are drained
leaving_pools() {{ stats_csv | awk -F, -v ids="$1" '$1 ~ /^{POOL_PREFIX}/ && $2 ~ /^replica[0-9]+$/ {{
      p = substr($1, {len(POOL_PREFIX) + 1}); i = substr($2, 8)
      if (index(ids, " " i " ")) mine[p] = 1; else if ($18 == "UP") other[p] = 1 }}
      END {{ for (p in mine) if (!(p in other)) print p }}'; }}
# the pools whose flag is up (a roll cut short left it so)
raised_pool_flags() {{ stats_csv | awk -F, '$1 == "{ROLLING_BACKEND}" && $2 ~ /^{ROLLING_SERVER}_/ && $18 !~ /^MAINT/ {{
      print substr($2, {len(ROLLING_SERVER) + 2}) }}'; }}
# requests queued or in flight there (through its pool too: a family's requests go by pool_<family>,
# whose server tracks this one), and its state (UP, DRAIN, DOWN, MAINT...)
fd_state() {{ stats_csv | awk -F, -v s="replica$I" '$2 == s && ($1 == "servers" || $1 ~ /^{POOL_PREFIX}/) {{ n += $3 + $5 }}
      $1 == "servers" && $2 == s {{ state = $18 }} END {{ if (state != "") print n, state }}'; }}
"""
