# shellcheck shell=dash
# The host lock (converge/hostlock.py), the first part of the script a run holds open on the
# host; its facts follow, then the loop that keeps it. $LOCK is the lock file, $MODE says how:
#  take  a run that may change the host: wait up to $WAIT s for the lock, name $HOLDER in
#        $LOCK.holder, then say "locked" (first "busy HOLDER" when another run has it)
#  peek  a read-only run: it takes no lock and writes nothing (no folder, no file, no holder);
#        it says "busy HOLDER" when a run holds the lock now, then "reading", and reads on
exec 2>&1
if [ "$MODE" = peek ]; then
  # a shared lock tried and let go at once: it fails only while a run holds the lock
  if [ -e "$LOCK" ] && ! flock -n -s "$LOCK" true; then
    printf 'busy %s\n' "$(cat "$LOCK.holder" 2>/dev/null)"
  fi
  echo reading
else
  [ -d "${LOCK%/*}" ] || mkdir -p "${LOCK%/*}"
  exec 9>>"$LOCK"
  if ! flock -n 9; then
    printf 'busy %s\n' "$(cat "$LOCK.holder" 2>/dev/null)"
    flock -w "$WAIT" 9 || { echo timeout; exit 75; }
  fi
  printf '%s\n' "$HOLDER" > "$LOCK.holder"
  echo locked
fi
