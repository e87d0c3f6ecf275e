# shellcheck shell=dash
# `invoke usage` (day2/usage.py): the usage service's day files (STATE_DIR/DAY.json) from SINCE on,
# each as one line of JSON; none when the folder is not there (no gateway yet). Parameters:
# STATE_DIR, SINCE (a day, 2026-11-01).
cd "$STATE_DIR" 2>/dev/null || exit 0
printf '%s\n' ./*.json | sed 's|^[.]/||' | awk -v s="$SINCE.json" '/^[0-9-]+[.]json$/ && $0 >= s' |
  while IFS= read -r f; do tr -d '\n' < "$f"; echo; done
