# shellcheck shell=dash
# After states.sh and systemd.sh (an HAProxy instance, a front door or a gateway, started,
# restarted or reloaded: ACTION): waited for until https /health on this host answers with its new
# configuration's generation (serving/haproxy/steps.py). A reload not acted on after AGAIN_S seconds
# is signalled once more (HAProxy's master now and then acts on no SIGUSR2: seen on 2.6); one not taken after
# GRACE_S seconds, with FALLBACK=1, becomes a restart. Parameters: UNIT, STATE_FILE, URL, RESOLVE,
# CA_FILE, GENERATION, TIMEOUT_S, FALLBACK, GRACE_S, AGAIN_S, CONFIG (its configuration file, named
# when it times out). Its result: state (ready; failed: its unit failed, its last log lines
# before; timeout), seconds, the unit's state, the generation it answered as, and (timeout) the
# one its files name.

# what the instance said besides its access log (each line once: units older than the
# passthrough log driver logged each line twice)
journal() { journalctl -u "$UNIT" -n 400 --no-pager -o cat 2>/dev/null | grep -v 'HTTP/[0-9.]*"$' | grep -v '^[[:space:]]*$' \
  | awk '!seen[$0]++' | tail -n 15 | sed 's/^/  | /'; }
fall_back() { rm -f "$STATE_FILE"; systemctl restart "$UNIT"; }
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
