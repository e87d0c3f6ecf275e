# shellcheck shell=dash
# Before systemd.sh acts on an HAProxy instance (serving/haproxy/steps.py): a start or restart begins
# with no state of an earlier instance (its checks find the servers' own), a reload with what the
# running one knows of the servers its new configuration keeps (keep_states.sh).
# Parameters: ACTION, STATE_FILE (and keep_states.sh's).
case $ACTION in
  start|restart) rm -f "$STATE_FILE" ;;
  reload) keep_states ;;
esac
