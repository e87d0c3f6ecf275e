# shellcheck shell=dash
# Whether this host reaches the run's artifact relay (serving/relay_probe.py): it answers URL with "relay".
# Parameters: URL.
curl -fsS --max-time 3 "$URL" 2>&1
