# shellcheck shell=dash
# A container's image pulled (serving/container_unit): through the run's relay when RELAYED names
# it there (each layer crosses the uplink once for all hosts of the run), tagged as REF, the
# relay's name dropped; from the registry itself when the relay fails (@relay-failed, after the
# last line of the relay's error: the report shows it).
# Parameters: RUNTIME, REF, RELAYED (empty: no relay).
if [ -z "$RELAYED" ]; then
  "$RUNTIME" pull -q "$REF" >/dev/null
  exit
fi
if { "$RUNTIME" pull -q --tls-verify=false "$RELAYED" >/dev/null; } 2>&1; then
  "$RUNTIME" tag "$RELAYED" "$REF" && "$RUNTIME" untag "$RELAYED" "$RELAYED"
else
  echo '@relay-failed'
  "$RUNTIME" pull -q "$REF" >/dev/null
fi
