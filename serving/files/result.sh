# shellcheck shell=dash
# result NAME=VALUE...: a program's result line, `@result {JSON}` (serving/host_programs.py), with
# each NAME's VALUE as a number when it is one, else as text in which nothing can break the line or
# its JSON: a double quote becomes a single one, a backslash a slash, a tab or line break a blank,
# and other control characters go (JSON needs no other escape).
result() {
  _r=""
  for _kv in "$@"; do
    _v=${_kv#*=}
    case $_v in
      0|[1-9]|[1-9]*[0-9]) case $_v in *[!0-9]*) _v="\"$(result_text "$_v")\"" ;; esac ;;
      *) _v="\"$(result_text "$_v")\"" ;;
    esac
    _r="$_r${_r:+, }\"${_kv%%=*}\": $_v"
  done
  printf '@result {%s}\n' "$_r"
}
result_text() { printf '%s' "$1" | tr '"\\\011\012\015' "'/   " | tr -d '\000-\037\177'; }
