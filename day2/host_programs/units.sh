# shellcheck shell=dash
# What the day-2 readings share (day2/readings.py): the replica units a host has and the port
# each one's process listens on, read from the host, not made here.

# the replica units (UNIT_GLOBS: their unit files, as serving/replicas.py globs them), blank-
# separated; FIRST_UNIT when there is none
replica_units() {
  found=""
  for f in $UNIT_GLOBS; do
    [ -f "$f" ] && found="$found ${f##*/}"
  done
  printf '%s\n' "${found:-$FIRST_UNIT}"
}
# the main process of the unit $1 (nothing when it has none)
main_pid() {
  pid=$(systemctl show -p MainPID --value "$1" 2>/dev/null)
  [ "${pid:-0}" != 0 ] && [ -r "/proc/$pid/cmdline" ] && printf '%s\n' "$pid"
  return 0
}
# the port vLLM listens on in the command line of the process $1 (its --port; nothing when none)
listening_port() {
  tr '\0' '\n' < "/proc/$1/cmdline" 2>/dev/null | awk 'take { print; exit } $0 == "--port" { take = 1 }
    /^--port=/ { sub(/^--port=/, ""); print; exit }' | grep -E '^[0-9]+$'
  return 0
}
