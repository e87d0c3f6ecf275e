# shellcheck shell=dash
# result NAME=VALUE...: a program's result line, `@result {JSON}` (roles/host_programs.py), with
# each NAME's VALUE as a number when it is one, else as text with only the characters that need no
# quoting in JSON (letters, digits, blanks and ._:/@+-), so that no value can break the line.
result() {
  _r=""
  for _kv in "$@"; do
    _v=${_kv#*=}
    case $_v in
      0|[1-9]|[1-9]*[0-9]) case $_v in *[!0-9]*) _v="\"$(printf '%s' "$_v" | tr -cd 'A-Za-z0-9 ._:/@+-')\"" ;; esac ;;
      *) _v="\"$(printf '%s' "$_v" | tr -cd 'A-Za-z0-9 ._:/@+-')\"" ;;
    esac
    _r="$_r${_r:+, }\"${_kv%%=*}\": $_v"
  done
  printf '@result {%s}\n' "$_r"
}
