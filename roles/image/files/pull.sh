# The chosen image pulled (unless PULL=0), through the run's relay when RELAYED names it there
# (podman: pulled from the relay, tagged as REF, the relay's name dropped; from the registry
# itself when that fails, after @relay-failed), then REF, its registry digest and its arch
# recorded in RECORD (written whole, then renamed). The pull's own lines stream as they come
# (the progress display reads them; why a pull failed is in them).
# KNOWN_DIGEST, KNOWN_ARCH (docker, a pull of an image already here and recorded: the record's):
# when docker says the tag has not moved from KNOWN_DIGEST, the record stands and the image is
# not inspected again (a docker CLI is a second of CPU on the lab's emulated spark01, whose
# image_pull: always pulls at every deploy).
# Parameters: RUNTIME, REF, PULL (1 or 0), RELAYED (empty: no relay), RECORD, STATE_DIR,
# KNOWN_DIGEST, KNOWN_ARCH (both empty: none known).
# Result: digest (the registry's; empty: none known), arch.
set -e

# docker pull $REF, its lines passed on as they come; exit 0 when it said the image is up to date
# at KNOWN_DIGEST, 100 when it pulled otherwise, else the pull's own exit status
pull_unless_unmoved() {
  { docker pull "$REF" 2>&1; printf 'pull exit status %s\n' "$?"; } | {
    at_known=no
    up_to_date=no
    while IFS= read -r line; do
      case $line in
        "pull exit status 0") if [ $at_known = yes ] && [ $up_to_date = yes ]; then exit 0; fi; exit 100 ;;
        "pull exit status "*) exit "${line#pull exit status }" ;;
        "Digest: $KNOWN_DIGEST") at_known=yes ;;
        "Status: Image is up to date for "*) up_to_date=yes ;;
      esac
      printf '%s\n' "$line"
    done
    exit 1
  }
}

if [ "$PULL" = 1 ] && [ "$RUNTIME" = docker ] && [ -z "$RELAYED" ] && [ -n "$KNOWN_DIGEST" ]; then
  rc=0
  pull_unless_unmoved || rc=$?
  if [ $rc = 0 ]; then
    printf '@result {"digest": "%s", "arch": "%s"}\n' "$KNOWN_DIGEST" "$KNOWN_ARCH"
    exit 0
  fi
  [ $rc = 100 ] || exit "$rc"
  PULL=0  # pulled: recorded below
fi
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
