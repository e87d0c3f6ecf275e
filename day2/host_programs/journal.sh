# shellcheck shell=dash
# `invoke logs` (day2/logs.py), after units.sh: the replica units' journal in one journalctl (each
# line naming its unit when there are several). Every replica unit the host has (UNIT_GLOBS;
# FIRST_UNIT when none), or with WANTED (the unit files of the replica asked for, under each
# family's name) that one; when the host has it under no name, the replica units it has go to
# stderr and the program exits EXIT_NO_REPLICA. A host with no replica unit: the fleet's other units
# it has (OTHER_UNITS), else FIRST_UNIT. Parameters: UNIT_GLOBS, FIRST_UNIT, WANTED, OTHER_UNITS,
# LINES, FOLLOW (1: follow the journal).
if [ -n "$WANTED" ]; then
  units=$(UNIT_GLOBS=$WANTED; FIRST_UNIT=; replica_units)
  if [ -z "${units# }" ]; then
    (FIRST_UNIT=; replica_units) | tr ' ' '\n' | grep . >&2
    exit "$EXIT_NO_REPLICA"
  fi
else
  units=$(FIRST_UNIT=; replica_units)
  # a host with no replica (a gateway, a monitoring host): the fleet's other units it has (OTHER_UNITS:
  # their unit files' globs), the gateway's HAProxy and usage service, Prometheus, keepalived...
  if [ -z "${units# }" ]; then units=$(UNIT_GLOBS=$OTHER_UNITS; replica_units); fi
fi
set --
for u in $units; do set -- "$@" -u "$u"; done
format=short-iso
[ $# -gt 2 ] && format=with-unit
[ "$FOLLOW" = 1 ] && exec journalctl "$@" -n "$LINES" --no-pager -o "$format" -f
exec journalctl "$@" -n "$LINES" --no-pager -o "$format"
