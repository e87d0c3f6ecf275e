# shellcheck shell=dash
# Whether this host (a gateway) reaches each serving host's front door, before anything changes on
# it (roles/gateway: reach_steps): a TCP connection to each, 3 s at most. Taken or refused, the host
# is there (a new host's front door is not up yet); no answer or no route, it is not.
# Parameters: DOORS: "NAME ADDRESS PORT" a line.
command -v bash >/dev/null 2>&1 || { echo "bash is not on this host: it asks with bash's /dev/tcp" >&2; exit 3; }
printf '%s\n' "$DOORS" | while read -r name address port; do
  [ -n "$name" ] || continue
  # bash's /dev/tcp: its arguments are expanded by that bash, not this shell
  # shellcheck disable=SC2016
  if why=$(timeout 3 bash -c 'exec 3<>"/dev/tcp/$1/$2"' reach "$address" "$port" 2>&1); then
    echo "door $name reached"
  else
    case "$why" in
      *refused*) echo "door $name reached" ;;
      '') echo "door $name unreachable no answer within 3 s" ;;
      *) echo "door $name unreachable $(printf '%s' "$why" | sed -n '$s/^.*: //p')" ;;
    esac
  fi
done
