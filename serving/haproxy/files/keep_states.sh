# shellcheck shell=dash
# keep_states: what the running HAProxy instance knows of its servers (up, down, drained), for a
# reload's new instance to start from, kept for the servers its new configuration keeps at the same
# address and port (KEPT_SERVERS: "backend server address port" a line; HAProxy would restore a
# server's old address and port from the file over a new one). Dumped through its runtime API
# (RUNTIME_SOCKET; curl speaks telnet to the unix socket: no socat needed on the host) to the file
# the new instance reads (STATE_FILE). Parameters: STATE_FILE, RUNTIME_SOCKET, KEPT_SERVERS.
# fields of `show servers state` (version 1): 2 be_name, 4 srv_name, 5 srv_addr, 19 srv_port
keep_states() {
  keep=$(mktemp) || return 0
  printf '%s\n' "$KEPT_SERVERS" > "$keep"
  echo 'show servers state' | curl -sS --max-time 5 --unix-socket "$RUNTIME_SOCKET" telnet://localhost 2>/dev/null \
    | awk 'NR == FNR { k[$0] = 1; next } /^#/ || NF < 19 { print; next } (($2 " " $4 " " $5 " " $19) in k)' \
      "$keep" - > "$STATE_FILE.new"
  # nothing read (no instance answered): no state, as at a start
  if [ -s "$STATE_FILE.new" ]; then mv -f "$STATE_FILE.new" "$STATE_FILE"; else rm -f "$STATE_FILE.new" "$STATE_FILE"; fi
  rm -f "$keep"
}
