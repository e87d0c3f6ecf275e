# shellcheck shell=dash
# What the weights' programs share (roles/weights/download.py): the token, from $TOKEN_B64 (base64;
# empty: none), into a variable and to curl in its config on its stdin (auth): never on a command
# line, never in the environment of a command; and curl as every fetch runs it, giving a
# connection up after $STALL_S seconds without a byte.
token=$(printf '%s' "$TOKEN_B64" | base64 -d)
auth() { [ -z "$token" ] || printf 'header = "Authorization: Bearer %s"\n' "$token"; }
hub_curl() { curl -sSL -K - --connect-timeout 15 --speed-limit 1 --speed-time "$STALL_S" "$@"; }
