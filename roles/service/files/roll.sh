# shellcheck shell=dash
# The roll (roles/service/rollout.py): the one way a running replica is changed. Out of
# service in its host's front door (and so, when it was the host's last, in the gateway),
# the action, the gate where it comes back, back in service; said step by step in markers,
# and how it ended in one result line, last (rollout.ROLL declares them and the exit codes,
# EXIT_*): outcome (done, failed, write-failed, rolled-back, rollback-failed), ms (when it
# ended), why (what failed), units (the unit that failed its wait, or those that did not answer
# in time), failed_ms (when it failed), again (why going back failed too), ready_ms (how long
# the replicas took to answer; blank when none was waited for).
#
# Parameters: ACTION (restart, start, stop, recover, remove); REPLICAS, the replicas it acts
# on (serving/replicas.py: index unit container port server gpus, a line each); RT, the
# runtime; ENV_FILE, vLLM's key; ADMIN and the front door's names (admin.sh); FRONTDOOR_CA,
# RESOLVE, GATE_URL, GATE_BODY: the gate's completion through the front door;
# DRAIN_TIMEOUT_MS, READY_TIMEOUT_S; GATEWAY_WAIT (1: a gateway fronts the fleet: the gateways
# see a pool's flag before its last replicas here drain); START_AGAIN (recover: 1, start it again);
# ROLL_LOCK, the host's roll lock file, and ROLL_LOCK_WAIT_S, how long a roll waits for another to
# end; HOLD (1: a trial, `invoke tune`'s: once it has passed its gate the replica stays out of
# service, its flags up, until a later roll or deploy puts it back; a trial that fails goes back as
# any change does, and back in service). A deploy's change
# (GO_BACK=1): WRITE=1 and UNIT_PATH, the unit `write_unit` writes (WRITE=0: a new image or
# weights alone); REF, the image reference the unit
# that runs names too (a moved tag is pointed back at what ran); BEFORE_REPLICAS, the
# replica as it runs now under another unit (a move to its family's name), and
# REMOVE_PATHS, the files that go with that unit once the move has passed its gate (or,
# ACTION remove, with the replica's own).

# what happens here must finish even if the control machine goes away
trap '' HUP PIPE

# the replicas of the table $1 (serving/files/replicas.sh): EACH (their indices), UNITS, COUNT
table() {
  REPLICAS=$1
  EACH=$(table_field index "$REPLICAS")
  UNITS=$(table_field unit "$REPLICAS")
  COUNT=$(printf '%s\n' "$EACH" | grep -c .)
}
# the replica of index $1: I, U (its unit), C (its container), P (its port), S (its server),
# WANT_GPUS (its GPUs, sorted, blank-separated; none: not checked)
use() { use_replica "$1" "$REPLICAS"; }
# the replica's requests at the front door (queued and in flight) and its state there: FD_N, FD_STATE
fd_now() {
  FD_N=0; FD_STATE=""
  read -r FD_N FD_STATE <<STATE
$(fd_state)
STATE
}
table "$REPLICAS"

journal() { for j in $UNITS; do [ "$COUNT" -gt 1 ] && echo "  | -- $j"; journalctl -u "$j" -n 25 --no-pager -o cat --since "@$1" 2>/dev/null | sed 's/^/  | /'; done; }

drained=""; flagged=0; leaving=""
is_drained() { case " $drained " in *" $I "*) return 0;; esac; return 1; }
# back in service, whatever ends the script: the replicas drained, the flags raised
undrain() {
  for i in $drained; do
    use "$i"
    if admin ready; then say "@in-service $I $(now_ms)"; else say "@undrain-failed $I $S"; fi
  done
  drained=""
  if [ $flagged = 1 ]; then flag maint || say "@unflag-failed $ROLLING_SERVER"; flagged=0; fi
  for p in $leaving; do pool_flag "$p" maint || say "@unflag-failed ${ROLLING_SERVER}_$p"; done; leaving=""
}
outcome=""; failure=""; failed_units=""; failed_ms=""; again=""; ready_ms=""
# what failed, as the result says it: from the wait's or the gate's $why and the units the wait names
failed() { failure=${1:-$why}; failed_units=${failed_unit:-$late}; failed_ms=$(now_ms); }
# whatever ends the script: back in service (a trial that passed: held out), then the result, its last line
finish() {
  rc=$?
  if [ "$HOLD" = 1 ] && [ "$outcome" = "done" ]; then
    for i in $drained; do say "@held $i"; done
  else
    undrain
  fi
  [ -n "$outcome" ] || { outcome=failed; failure=${failure:-it ended before it said how (exit $rc)}; }
  result outcome="$outcome" ms="$(now_ms)" why="$failure" units="$failed_units" failed_ms="$failed_ms" \
    again="$again" ready_ms="$ready_ms"
}
trap finish EXIT

# 0. one roll at a time on a host. The run's host lock keeps two runs apart, but a roll that
# reached the host as its run lost the link (TCP delivers what was sent, and sshd starts it)
# runs on without that lock, to its end by design: the next run's roll waits here for it
# (ROLL_LOCK_WAIT_S at most: then it fails, having changed nothing) instead of draining and
# restarting the same replicas beside it. The lock is the file's: it goes with this shell
[ -d "${ROLL_LOCK%/*}" ] || mkdir -p "${ROLL_LOCK%/*}"
exec 9>>"$ROLL_LOCK"
if ! flock -n 9; then
  waited_from=$(now_ms)
  if ! flock -w "$ROLL_LOCK_WAIT_S" 9; then
    outcome=failed; failed "another roll of this host's replicas was still under way after ${ROLL_LOCK_WAIT_S} s"
    exit "$EXIT_FAILED"
  fi
  say "@waited $(( $(now_ms) - waited_from ))"
fi
say "@begin $(now_ms)"

# 1. out of service: the host's rolling flag up (the gateway holds it out while none is in
# service), then no new requests for these replicas; those in flight finish (up to the drain
# timeout). The last replicas in service of a family here: its pool's flag first, and the
# gateways' next check takes the host out for it before they drain
if [ -S "$ADMIN" ]; then
  servers=" "; for i in $EACH; do use "$i"; servers="$servers$S "; done
  for p in $(leaving_pools "$servers"); do pool_flag "$p" ready && leaving="$leaving $p"; done
  if [ -n "$leaving" ] && [ "$GATEWAY_WAIT" = 1 ]; then say "@gateways-saw $(gateways_see "$leaving")"; fi
fi
for i in $EACH; do
  use "$i"
  if [ -S "$ADMIN" ] && [ -n "$(fd_state)" ]; then
    [ $flagged = 1 ] || { flag ready && flagged=1; }
    admin drain && drained="$drained $I"
  fi
done
if [ "$HOLD" = 1 ] && [ -z "$drained" ]; then
  # a trial's replica must be out of every user's way: nothing holds it out without its front door
  outcome=failed; failed "no front door holds replica $EACH out of service, and a trial needs one: deploy the host first"
  exit "$EXIT_FAILED"
fi
if [ -n "$drained" ]; then
  start=$(now_ms)
  while :; do
    left=0
    for i in $drained; do use "$i"; fd_now; left=$(( left + ${FD_N:-0} )); done
    if [ "$left" = 0 ] || [ $(( $(now_ms) - start )) -ge "$DRAIN_TIMEOUT_MS" ]; then break; fi
    sleep 0.2
  done
  say "@drained $(( $(now_ms) - start )) $left"
else
  say "@no-frontdoor"
fi

# 3. the gate: through the front door, pinned to this replica (it reaches a drained one), or
# on its loopback port when no front door holds it; then its checks that a release can break
gate() {
  answer=$(mktemp); via=loopback
  if is_drained; then
    # first the front door must see it up. It answered here, so it is up: said at once (hrunn),
    # not after the front door's next checks (its own checks go on, and would take it down
    # again if it failed them)
    admin hrunn
    start=$(now_ms)
    while :; do
      fd_now; state=$FD_STATE
      if [ "$state" = DRAIN ] || [ "$state" = UP ]; then break; fi
      if [ $(( $(now_ms) - start )) -ge 30000 ]; then why="the front door did not see it up within 30 s ($state)"; rm -f "$answer"; return 1; fi
      sleep 0.3
    done
  fi
  if is_drained && [ -n "$key" ]; then
    via="the front door"
    code=$(auth | curl -sS -K - -o "$answer" -w '%{http_code}' --max-time 120 --cacert "$FRONTDOOR_CA" --resolve "$RESOLVE" \
      -H "X-Dgemma-Replica: $I" -H 'Content-Type: application/json' --data "$GATE_BODY" "$GATE_URL" 2>&1)
  else
    code=$(auth | curl -sS -K - -o "$answer" -w '%{http_code}' --max-time 120 -H 'Content-Type: application/json' \
      --data "$GATE_BODY" "http://127.0.0.1:$P/v1/chat/completions" 2>&1)
  fi
  if [ "$code" != 200 ] || ! grep -q '"choices"' "$answer"; then
    why="a chat completion through $via answered ${code:-nothing}: $(head -c 200 "$answer" | tr '\n' ' ')"; rm -f "$answer"; return 1
  fi
  rm -f "$answer"
  # its verify checks that a release can break: vLLM on loopback only, its own GPUs only
  open=$(ss -Hltn "sport = :$P" 2>/dev/null | awk '{print $4}' | grep -v -e '^127\.0\.0\.1:' -e '^\[::1\]:' | head -n 1)
  if [ -n "$open" ]; then why="it listens on $open, not on loopback only"; return 1; fi
  if [ -n "$WANT_GPUS" ]; then
    seen=$("$RT" exec "$C" nvidia-smi -L 2>/dev/null | sed -n 's/.*(UUID: \([^)]*\)).*/\1/p' | sort | tr '\n' ' ' | sed 's/ $//')
    if [ "$seen" != "$WANT_GPUS" ]; then why="it sees GPUs '$seen', not its own '$WANT_GPUS'"; return 1; fi
  fi
  say "@gate-passed $I $via"
}
# every replica of the roll ready (one readiness loop), then each through its gate
come_back() {
  await_ready "$READY_TIMEOUT_S" "$REPLICAS" || return 1
  ready_ms=$waited_ms
  for i in $EACH; do use "$i"; gate || { why="replica $I: $why"; return 1; }; done
}
# a stopped replica is back in the front door's rotation once its checks see it down
await_down() {
  for i in $EACH; do
    use "$i"; is_drained || continue; start=$(now_ms)
    while :; do
      fd_now; case "$FD_STATE" in DOWN*|MAINT*|"") break;; esac
      [ $(( $(now_ms) - start )) -ge 15000 ] && break
      sleep 0.3
    done
  done
}
# recover: the replica's unit stopped and reset (ends a restart loop), its container's
# processes killed, the container removed; each said as it is done
clear_replica() {
  timeout 120 systemctl stop "$U"; systemctl kill -s KILL "$U" 2>/dev/null
  systemctl reset-failed "$U" 2>/dev/null
  killed=""
  # podman: the container's process and its conmon; docker: its process (containerd's shim
  # reaps it), then docker's own SIGKILL
  if [ "$RT" = podman ]; then pids='{{.State.Pid}} {{.State.ConmonPid}}'; else pids='{{.State.Pid}}'; fi
  for p in $("$RT" inspect --format "$pids" "$C" 2>/dev/null | tr ' ' '\n' | grep -v '^0$' | grep -v '^$'); do
    kill -9 "$p" 2>/dev/null && killed="$killed $p"
  done
  if [ "$RT" = podman ]; then
    # podman waits at most 1 s for a stop (seed 000); docker's rm -f kills at once
    timeout 60 "$RT" rm -f --time 1 "$C" >/dev/null 2>&1
  else
    "$RT" kill --signal KILL "$C" >/dev/null 2>&1 && killed="$killed docker-kill"
    timeout 60 "$RT" rm -f "$C" >/dev/null 2>&1
  fi
  if "$RT" inspect "$C" >/dev/null 2>&1; then
    failed "replica $I: the container is still there"; outcome=failed; exit "$EXIT_FAILED"
  fi
  say "@cleared $I${killed:- none}"
}
restart() {
  units "$UNITS" reset-failed 2>/dev/null
  units "$UNITS" restart || { why="systemctl restart failed"; return 1; }
}
# the paths of $REMOVE_PATHS (schema-checked: no blank in one) removed
remove_paths() { printf '%s\n' "$REMOVE_PATHS" | xargs -r rm -f; }
done_() { outcome="done"; exit 0; }
# the action or its gate failed: said with the journal since the action began
fail() { failed "$1"; journal "$failed_at"; outcome=failed; exit "$EXIT_FAILED"; }

# 2. the action
failed_at=$(date +%s)
case $ACTION in
stop)
  # a container whose runtime exits non-zero as it is stopped leaves the unit "failed": it was asked to stop
  if units "$UNITS" stop; then
    units "$UNITS" reset-failed 2>/dev/null; await_down; say "@stopped $(now_ms)"; done_
  fi
  fail "systemctl stop failed";;
remove)
  units "$UNITS" disable --now 2>/dev/null
  units "$UNITS" reset-failed 2>/dev/null
  remove_paths
  systemctl daemon-reload
  await_down; say "@removed $(now_ms)"; done_;;
recover)
  for i in $EACH; do use "$i"; clear_replica; done
  if [ "$START_AGAIN" = 1 ]; then
    units "$UNITS" reset-failed 2>/dev/null
    if units "$UNITS" start && come_back; then done_; fi
    fail
  fi
  await_down; done_;;
start)
  units "$UNITS" reset-failed 2>/dev/null
  if units "$UNITS" start && come_back; then done_; fi
  fail "${why:-systemctl start failed}";;
esac

# restart: day 2's (nothing to go back to), or deploy's change (GO_BACK=1)
if [ "$GO_BACK" != 1 ]; then
  if restart && come_back; then done_; fi
  fail
fi
# what runs now, to go back to: the unit (kept as .previous when rewritten), or the unit it
# runs under now (BEFORE_REPLICAS), and the image it runs, by its id
NEW_REPLICAS=$REPLICAS
[ -n "$BEFORE_REPLICAS" ] && table "$BEFORE_REPLICAS"
for i in $EACH; do use "$i"; done
old_image=$("$RT" inspect --format '{{.Image}}' "$C" 2>/dev/null)
old_units=$UNITS
table "$NEW_REPLICAS"
had=0; [ -f "$UNIT_PATH" ] && had=1
wrote=0
if [ "$WRITE" = 1 ]; then
  if write_unit; then wrote=1; else outcome=write-failed; exit "$EXIT_WRITE_FAILED"; fi
fi
systemctl daemon-reload
# a move to the family's name: the unit it ran under stops first (the GPU is one replica's)
[ -n "$BEFORE_REPLICAS" ] && { units "$old_units" stop; units "$old_units" reset-failed 2>/dev/null; }
if restart && come_back; then
  if [ -n "$BEFORE_REPLICAS" ]; then
    units "$old_units" disable 2>/dev/null
    remove_paths; systemctl daemon-reload; say "@replaced $(printf '%s' "$old_units" | tr '\n' ' ')"
  fi
  done_
fi
failed
journal "$failed_at"
# back to exactly what ran: its unit, and the image it ran (a moved tag names it again)
if [ $wrote = 1 ]; then
  if [ $had = 1 ]; then mv -f "$UNIT_PATH.previous" "$UNIT_PATH"; else
    units "$UNITS" stop 2>/dev/null; rm -f "$UNIT_PATH"; fi
fi
if [ -n "$old_image" ] && [ -n "$REF" ]; then
  now_id=$("$RT" image inspect --format '{{.Id}}' "$REF" 2>/dev/null)
  if [ "${now_id#sha256:}" != "${old_image#sha256:}" ]; then "$RT" tag "$old_image" "$REF" && say "@retagged"; fi
fi
systemctl daemon-reload
[ -n "$BEFORE_REPLICAS" ] && table "$BEFORE_REPLICAS"
if restart && come_back; then
  undrain; outcome=rolled-back; exit "$EXIT_ROLLED_BACK"
fi
again=$why; outcome=rollback-failed
journal "$failed_at"
exit "$EXIT_ROLLBACK_FAILED"
