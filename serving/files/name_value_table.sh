# shellcheck shell=dash
# A table of NAME=VALUE words, a line a row, as the toolkit hands tables to host programs (the
# replica table of serving/replicas.py, the weights' files of roles/weights/download.py): its rows
# read by name, whatever the order of their words. No value holds a blank; a value may hold "=".

# awk's fields(): the current row's words into f[NAME] (the first "=" of a word ends its name)
# shellcheck disable=SC2016 # awk's program, whose $k is awk's, not the shell's
ROW_AWK='function fields(   k, e) {
  split("", f); for (k = 1; k <= NF; k++) { e = index($k, "="); f[substr($k, 1, e - 1)] = substr($k, e + 1) } }'
