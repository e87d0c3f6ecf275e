# shellcheck shell=dash
# The HAProxy library's facts of a host (serving/haproxy/stats.py), a function each.

# the stats of the HAProxy instance whose admin socket is $1, as CSV (nothing when it does not
# answer: not running, or older than that socket)
fact_server_states() {
  if [ -S "$1" ]; then curl -sS --max-time 2 --unix-socket "$1" 'http://proxy/;csv' 2>/dev/null; fi
  true
}
