# shellcheck shell=dash
# A host's facts, gathered in one round trip (converge/facts/__init__.py): fact N (from 0, named by
# the Nth word of NAMES) is the function _fact_N, defined before this. Each runs in a subshell of
# its own (its `exit` or `set -e` ends no other), framed by BOUNDARY, its name, and at its end its
# exit status. Side by side, each writing to a file of a private temporary folder, printed in order
# once all have ended (a host that starts programs slowly waits for them once, not one by one);
# where no folder can be made (a full or read-only /tmp), one after another, straight out.
# Parameters: BOUNDARY, NAMES.
exec 2>&1
LC_ALL=C
export LC_ALL
framed() {
  printf '%s begin %s\n' "$BOUNDARY" "$2"
  ( "_fact_$1" ) </dev/null
  printf '\n%s end %s %s\n' "$BOUNDARY" "$2" $?
}
if _facts=$(mktemp -d 2>/dev/null); then (
  # the folder goes with the subshell, however it ends (a lost link: its `cat` gets SIGPIPE)
  trap 'rm -rf "$_facts"' EXIT
  trap 'exit 1' HUP INT TERM PIPE
  set --
  n=0
  for name in $NAMES; do
    framed "$n" "$name" >"$_facts/$n" 2>&1 </dev/null &
    set -- "$@" "$_facts/$n"
    n=$((n + 1))
  done
  wait
  [ $# -eq 0 ] || cat "$@"
) else
  n=0
  for name in $NAMES; do
    framed "$n" "$name"
    n=$((n + 1))
  done
fi
# the gathering's end: its reader reads up to this line
printf '%s done\n' "$BOUNDARY"
