# shellcheck shell=dash
# A unit told one thing by systemctl (serving/systemd.py). DAEMON_RELOAD=1: systemd reads the unit
# files again first; ENABLE=1: the unit is enabled at boot first. ACTION: start or restart (a failed
# state reset first, so that a unit left failed starts), reload, stop, try-restart, enable, disable,
# remove (disabled and stopped, then its files REMOVE, a path a line, taken out) or none. The exit
# status is the action's; acted_at is when it began (date +%s). Parameters: UNIT, ACTION,
# DAEMON_RELOAD, ENABLE, REMOVE.
# shellcheck disable=SC2034 # read by the program this one begins: when the action began (s)
acted_at=$(date +%s)
[ "$DAEMON_RELOAD" != 1 ] || systemctl daemon-reload
[ "$ENABLE" != 1 ] || systemctl enable "$UNIT" 2>/dev/null
case $ACTION in
  none) ;;
  start|restart) systemctl reset-failed "$UNIT" 2>/dev/null; systemctl "$ACTION" "$UNIT" ;;
  remove)
    systemctl disable --now "$UNIT" 2>/dev/null
    printf '%s\n' "$REMOVE" | while IFS= read -r path; do [ -z "$path" ] || rm -f "$path"; done ;;
  *) systemctl "$ACTION" "$UNIT" ;;
esac
