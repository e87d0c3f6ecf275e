# shellcheck shell=dash
# Replicas a roll cut short left drained in the front door (a reboot or SIGKILL of its
# program, which otherwise puts them back itself), back in service, and the roll's flags
# lowered (roles/frontdoor/role.py). SERVERS: their servers, blank-separated.
for S in $SERVERS; do
  admin ready || { echo "@still-drained $S"; exit "$EXIT_REFUSED"; }
done
flag maint || true
for p in $(raised_pool_flags); do pool_flag "$p" maint || true; done
