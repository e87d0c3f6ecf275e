# The chosen image pulled (unless PULL=0), through the run's relay when RELAYED names it there
# (podman: pulled from the relay, tagged as REF, the relay's name dropped; from the registry
# itself when that fails, after @relay-failed), then REF, its registry digest and its arch
# recorded in RECORD (written whole, then renamed). The pull's own lines stream as they come
# (the progress display reads them; why a pull failed is in them).
# Parameters: RUNTIME, REF, PULL (1 or 0), RELAYED (empty: no relay), RECORD, STATE_DIR.
# Result: digest (the registry's; empty: none known), arch.
set -e
if [ "$PULL" = 1 ] && [ -n "$RELAYED" ]; then
  if "$RUNTIME" pull --tls-verify=false "$RELAYED" 2>&1; then
    "$RUNTIME" tag "$RELAYED" "$REF"
    "$RUNTIME" untag "$RELAYED" "$RELAYED"
  else
    echo '@relay-failed (the lines above say why)'
    "$RUNTIME" pull "$REF"
  fi
elif [ "$PULL" = 1 ]; then
  "$RUNTIME" pull "$REF"
fi
mkdir -p "$STATE_DIR"
inspect_image "$REF"
tmp=$(mktemp "$RECORD.XXXXXX")
printf '%s\n%s\n%s\n' "$REF" "$digest" "$arch" > "$tmp"
mv -f "$tmp" "$RECORD"
printf '@result {"digest": "%s", "arch": "%s"}\n' "$digest" "$arch"
