# shellcheck shell=dash
# `invoke logs --requests` (day2/usage.py): the gateway's request records (the usage service's
# journal lines of RECORDS_ID that are JSON records, each beginning with its "t"; an access line alone,
# of a health check or a scrape, begins with "time"), since SINCE (journalctl's --since) or else the last
# LINES, and of one key alone when KEY_NEEDLE (its `"key":"NAME",`) is set. Parameters:
# RECORDS_ID, SINCE, KEY_NEEDLE, LINES.
journal() {
  if [ -n "$SINCE" ]; then
    journalctl -t "$RECORDS_ID" --since "$SINCE" --no-pager -o cat 2>/dev/null
  else
    journalctl -t "$RECORDS_ID" --no-pager -o cat 2>/dev/null
  fi
}
of_key() { if [ -n "$KEY_NEEDLE" ]; then grep -F -- "$KEY_NEEDLE"; else cat; fi; }
last() { if [ -n "$SINCE" ]; then cat; else tail -n "$LINES"; fi; }
journal | grep '^{"t":' | of_key | last
true
