# shellcheck shell=dash
# An HAProxy instance (a front door, a gateway) enabled at boot (ENABLE=1), told to start, restart
# or reload (ACTION), then waited for until https /health on this host answers with its new
# configuration's generation (roles/haproxy/steps.py). A start or restart begins with no state of
# an earlier instance (its checks find the servers' own); a reload keeps what the running instance
# knows of the servers the new configuration keeps at the same address and port (KEPT_SERVERS:
# "backend server address port" a line), dumped through its runtime API (RUNTIME_SOCKET; curl
# speaks telnet to the unix socket) to the file the new instance reads (STATE_FILE): without it, a
# pool whose servers are all down would be called up, and sent requests, until the new instance's
# first checks. A reload not acted on after AGAIN_S seconds is signalled once more (HAProxy 2.6's
# master now and then acts on no SIGUSR2); one not taken after GRACE_S seconds, with FALLBACK=1,
# becomes a restart. keep_states is keep_states.sh's. Parameters: UNIT, ACTION (start, restart or
# reload), ENABLE, STATE_FILE, RUNTIME_SOCKET, KEPT_SERVERS, URL, RESOLVE, CA_FILE, GENERATION, TIMEOUT_S, FALLBACK, GRACE_S,
# AGAIN_S, CONFIG (its configuration file, named when it times out). Its result: state (ready;
# failed: its unit failed, its last log lines before; timeout), seconds, the unit's state, the
# generation it answered as, and (timeout) the one its files name.

# what the instance said besides its access log (each line once: units older than the
# passthrough log driver logged each line twice)
journal() { journalctl -u "$UNIT" -n 400 --no-pager -o cat 2>/dev/null | grep -v 'HTTP/[0-9.]*"$' | grep -v '^[[:space:]]*$' \
  | awk '!seen[$0]++' | tail -n 15 | sed 's/^/  | /'; }
fall_back() { rm -f "$STATE_FILE"; systemctl restart "$UNIT"; }
[ "$ENABLE" != 1 ] || systemctl enable "$UNIT" 2>/dev/null
case $ACTION in
  start) rm -f "$STATE_FILE"; systemctl daemon-reload; systemctl reset-failed "$UNIT" 2>/dev/null; systemctl start "$UNIT" ;;
  restart) rm -f "$STATE_FILE"; systemctl daemon-reload; systemctl restart "$UNIT" ;;
  reload) keep_states; systemctl reload "$UNIT" ;;
esac
start=$(date +%s)
fell_back=0
signalled=0
while :; do
  elapsed=$(( $(date +%s) - start ))
  state=$(systemctl is-active "$UNIT")
  if [ "$state" = failed ]; then
    journal; result state=failed seconds="$elapsed" unit_state="$state" answered="" files=""; exit "$EXIT_FAILED"
  fi
  # the certificate is checked against the fleet CA under the host's inventory name
  got=$(curl -sS -D - -o /dev/null --max-time 3 --cacert "$CA_FILE" --resolve "$RESOLVE" "$URL" 2>&1 \
        | tr -d '\r' | sed -n 's/^[Xx]-[Ff]rontdoor-[Gg]eneration: //p')
  if [ "$got" = "$GENERATION" ]; then
    result state=ready seconds="$elapsed" unit_state="$state" answered="$got" files=""; exit 0
  fi
  if [ "$FALLBACK" = 1 ]; then
    if [ $signalled = 0 ] && [ "$elapsed" -ge "$AGAIN_S" ]; then
      echo "@reload-signalled-again ${got:-no answer}"; signalled=1
      systemctl reload "$UNIT"
    fi
    if [ $fell_back = 0 ] && [ "$elapsed" -ge "$GRACE_S" ]; then
      echo "@reload-did-not-take ${got:-no answer}"; fell_back=1
      fall_back
    fi
  fi
  if [ "$elapsed" -ge "$TIMEOUT_S" ]; then
    journal
    result state=timeout seconds="$elapsed" unit_state="$state" answered="${got:-no answer}" \
      files="$(sed -n 's/.*[Xx]-[Ff]rontdoor-[Gg]eneration //p' "$CONFIG")"
    exit "$EXIT_TIMEOUT"
  fi
  sleep 0.3
done
