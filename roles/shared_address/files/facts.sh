# shellcheck shell=dash
# The shared address role's facts of a host (roles/shared_address/role.py), a function each.

# the host's IPv4 addresses, a line an address, as ip prints them
fact_ipv4_addresses() { ip -o -4 addr show; }
