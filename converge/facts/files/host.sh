# shellcheck shell=dash
# The engine's facts of a host (converge/facts/host.py), a function each, called with its fact's
# arguments. A gathering sends this file once, before the facts that call it.

fact_arch() { uname -m; }

fact_os_release() { cat /etc/os-release 2>/dev/null || cat /usr/lib/os-release; }

fact_meminfo() { cat /proc/meminfo; }

# "running", systemd's version line and the system's state, when systemd runs; else "absent"
fact_systemd() {
  if [ -d /run/systemd/system ]; then
    printf 'running '
    systemctl --version | head -n 1
    systemctl is-system-running 2>/dev/null
  else
    echo absent
  fi
}

# the free space where $1 is or would be made: df's line for its nearest folder that exists
fact_disk_free() {
  p=$1
  while [ ! -e "$p" ] && [ "$p" != / ]; do p=$(dirname "$p"); done
  df -Pk "$p" | tail -n 1
}

# yes when $1 is a folder, else no
fact_directory() { if [ -d "$1" ]; then echo yes; else echo no; fi; }

# each command named, and where it is (- when it is not there): "NAME PATH" a line
fact_commands() {
  for name in "$@"; do printf '%s %s\n' "$name" "$(command -v "$name" || echo -)"; done
}

# the file $1: its mode, owner, group and size, then its content in base64, or (when $2 is "secret":
# a secret's content never leaves the host) its sha256; "absent" when there is no such file
fact_file_state() {
  if [ -f "$1" ]; then
    stat -c '%a %U %G %s' "$1"
    # a secret's hash (its content never leaves the host); a file sent whole is hashed on our side
    if [ "$2" = secret ]; then sha256sum < "$1"; else base64 "$1"; fi
  else
    echo absent
  fi
}

# the files $2... as fact_file_state answers each ($1: "secret" or not), in one program of each
# kind for them all: a link, "@one PATH", fact_file_state's lines, "@one-end"; then a line
# "@state MODE OWNER GROUP SIZE PATH" for each other regular file (one stat; a file that no line
# names is absent), and "@hashes" and sha256sum's line of each, or "@content" and the bytes of
# them all, one after the other in that order, in base64 (cut back by their sizes on our side)
fact_file_states() {
  kind=$1
  shift
  count=$#
  for f; do
    if [ -L "$f" ]; then
      printf '@one %s\n' "$f"
      fact_file_state "$f" "$kind"
      echo '@one-end'
    elif [ -f "$f" ]; then
      set -- "$@" "$f"
    fi
  done
  shift "$count"
  [ $# -gt 0 ] || return 0
  # (a file gone since the test above: no line of its own, no bytes; its error not among the lines)
  stat -c '@state %a %U %G %s %n' -- "$@" 2>/dev/null
  if [ "$kind" = secret ]; then
    echo '@hashes'
    sha256sum -- "$@" 2>/dev/null
  else
    echo '@content'
    cat -- "$@" 2>/dev/null | base64
  fi
}

# the unit $1's load, active and enabled state, and when it entered it (units $1...: one
# block each, in that order, a blank line between)
fact_unit_state() {
  systemctl show "$@" -p LoadState -p ActiveState -p SubState -p UnitFileState -p NRestarts -p MainPID \
    -p ActiveEnterTimestampMonotonic -p ExecMainStatus -p NeedDaemonReload -p Result
}

# each file the globs $2... name: "@file PATH", then its first $1 bytes in base64
fact_text_files() {
  max=$1
  shift
  for pattern in "$@"; do
    # shellcheck disable=SC2086 # a glob (checked plain where it is made): expanded here on purpose
    for f in $pattern; do
      [ -f "$f" ] || continue
      printf '@file %s\n' "$f"
      head -c "$max" "$f" | base64
    done
  done
  true
}

# each unit file the globs $1... name: "@unit PATH", its file's state, "@state", its unit's state
fact_unit_files() {
  for pattern in "$@"; do
    # shellcheck disable=SC2086 # a glob (checked plain where it is made): expanded here on purpose
    for f in $pattern; do
      [ -f "$f" ] || continue
      printf '@unit %s\n' "$f"
      fact_file_state "$f"
      printf '@state\n'
      fact_unit_state "${f##*/}"
    done
  done
  true
}

# the response headers of $1 as the host sees it (its certificate not checked), asked again while
# curl times out (exit 28), $2 times in all
fact_http_headers() {
  try=0
  while [ "$try" -lt "$2" ]; do
    curl -sk -D - -o /dev/null --max-time 2 "$1" 2>/dev/null
    rc=$?
    [ "$rc" -eq 28 ] || break
    try=$((try + 1))
  done
  true
}
