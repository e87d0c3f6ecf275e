# shellcheck shell=dash
# The replica table (serving/replicas.py: shell_table writes it, read_table reads it there): one
# replica a line, each of its fields a NAME=VALUE word: index, unit, container, port, server and
# gpus (their uuids comma-separated; empty: not known, or every GPU). Read here by name, whatever
# the order of the words; no value holds a blank (each name is made by serving/replicas.py from
# schema-checked values).

# each replica's field $1 of the table $2, a line each, in the table's order
table_field() {
  printf '%s\n' "$2" | awk -v name="$1" "$ROW_AWK"' NF { fields(); if (name in f) print f[name] }'
}
# the fields $1 and $2 of each replica of the table $3 as one word, FIRST=SECOND, a line each
table_pairs() {
  printf '%s\n' "$3" | awk -v a="$1" -v b="$2" "$ROW_AWK"' NF { fields(); print f[a] "=" f[b] }'
}
# the replica of index $1 of the table $2: I, U (its unit), C (its container), P (its port),
# S (its server), WANT_GPUS (its GPUs, sorted, blank-separated; none: not checked)
use_replica() {
  # one awk for the six (it runs in loops, and a fork is slow on an emulated host); "-" holds an
  # empty field's place for read
  # shellcheck disable=SC2034 # what it tells the program that includes it
  read -r I U C P S WANT_GPUS <<REPLICA
$(printf '%s\n' "$2" | awk -v i="$1" "$ROW_AWK"' NF { fields(); if (f["index"] == i) { gpus = f["gpus"]
    gsub(",", " ", gpus); print f["index"], f["unit"], f["container"], f["port"], f["server"], (gpus == "" ? "-" : gpus)
    exit } }')
REPLICA
  [ "$WANT_GPUS" = "-" ] && WANT_GPUS=""
  return 0
}
# systemctl with the arguments after $1, then each unit of the list $1 (blank- or line-separated)
units() { list=$1; shift; printf '%s\n' "$list" | xargs -r systemctl "$@"; }
