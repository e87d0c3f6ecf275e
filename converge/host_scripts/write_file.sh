# shellcheck shell=dash
# write_file PATH MODE OWNER GROUP KEEP: PATH written so that no reader ever sees half a file
# (converge/changes.py). Its content comes in base64 on standard input (a heredoc of the script: a
# secret in it reaches no command line); the new file is whole, with its mode and owner, before
# `mv` puts it in place (its folders made first); with KEEP=1 the version it replaces stays as
# PATH.previous (a hard link: the same mode). PATH is absolute; its folder and name come from the
# shell itself, not dirname and basename: each program started costs a host under emulation (an
# aarch64 one under qemu-user) a tenth of a second.
write_file() (
  set -e
  d=${1%/*}
  d=${d:-/}
  [ -d "$d" ] || mkdir -p "$d"
  tmp=$(mktemp "$d/.${1##*/}.XXXXXX")
  trap 'rm -f "$tmp"' EXIT
  chmod "$2" "$tmp"
  chown "$3:$4" "$tmp"
  base64 -d >"$tmp"
  sync "$tmp" 2>/dev/null || true
  if [ "$5" = 1 ] && [ -f "$1" ]; then ln -f "$1" "$1.previous"; fi
  mv -f "$tmp" "$1"
  trap - EXIT
)
