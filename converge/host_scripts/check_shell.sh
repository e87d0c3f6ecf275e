# shellcheck shell=dash
# The check shell of `invoke verify` (converge/verify.py CheckShell): one shell per host that runs
# every check command of the run, each read from its standard input as its lines then BOUNDARY.
# Each runs in a subshell (`eval`: on no command line), its stdin /dev/null, its standard error in
# a file of a 0700 folder; back come its output, "BOUNDARY out", its exit status, its standard
# error, "BOUNDARY end". "BOUNDARY ready" first. Parameters: BOUNDARY.
_ck_dir=$(mktemp -d) || exit 1
trap 'rm -rf "$_ck_dir"' EXIT
trap 'exit 1' HUP INT TERM PIPE
_ck_nl='
'
printf '%s ready\n' "$BOUNDARY"
while :; do
  _ck_cmd=""
  while IFS= read -r _ck_line; do [ "$_ck_line" = "$BOUNDARY" ] && break; _ck_cmd="$_ck_cmd$_ck_line$_ck_nl"; done
  [ "$_ck_line" = "$BOUNDARY" ] || exit 0
  ( set --; eval "$_ck_cmd" ) </dev/null 2>"$_ck_dir/err"
  printf '\n%s out\n%s\n' "$BOUNDARY" "$?"
  if [ -s "$_ck_dir/err" ]; then cat "$_ck_dir/err"; fi
  printf '\n%s end\n' "$BOUNDARY"
done
