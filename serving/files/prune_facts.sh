# shellcheck shell=dash
# What prune weighs on a host (day2/prune.py): the space each image takes, as the runtime counts
# it, and the fleet's models in the Hugging Face cache, link by link.
# Parameters: RUNTIME (podman or docker), DOCKER_SOCKET, HUB (the cache's hub folder), HISTORY (the
# release history: the models it names are read, no other).
# Markers: @podman-df (what follows is `podman system df -v`), @docker-df JSON (the Engine API's
# /system/df), @model FOLDER, @ref NAME COMMIT, @snapshot COMMIT BLOB..., @blob NAME BYTES,
# @partial NAME BYTES HELD (1: a download holds its lock), @trash NAME (a prune cut short).
if [ "$RUNTIME" = podman ] && command -v podman >/dev/null 2>&1; then
  echo '@podman-df'
  podman system df -v 2>/dev/null | sed -n '/^Images space usage/,/^Containers space usage/p'
elif [ "$RUNTIME" = docker ]; then
  if docker_api_usable "$DOCKER_SOCKET" && df=$(docker_api "$DOCKER_SOCKET" /system/df 2>/dev/null); then
    printf '@docker-df %s\n' "$(printf '%s' "$df" | tr -d '\n')"
  elif command -v docker >/dev/null 2>&1; then
    printf '@docker-df %s\n' "$(docker system df -v --format '{{json .}}' 2>/dev/null | tr -d '\n')"
  fi
fi
models=$(grep -o '"model": "[^"]*"' "$HISTORY" 2>/dev/null | sed 's/.*: "//; s/"$//; s|/|--|' | sort -u)
for model in $models; do
  folder=models--$model
  repo=$HUB/$folder
  [ -d "$repo" ] || continue
  echo "@model $folder"
  for ref in "$repo"/refs/*; do
    [ -f "$ref" ] && printf '@ref %s %s\n' "${ref##*/}" "$(cat "$ref")"
  done
  for snap in "$repo"/snapshots/*; do
    [ -d "$snap" ] || continue
    printf '@snapshot %s' "${snap##*/}"
    find "$snap" -type l -exec readlink {} + 2>/dev/null | sed 's|.*/||' | sort -u | tr '\n' ' ' | sed 's/ $//; s/^/ /'
    echo
  done
  for trash in "$repo"/.dgemma-pruning-*; do
    [ -e "$trash" ] && printf '@trash %s\n' "${trash##*/}"
  done
  for blob in "$repo"/blobs/*; do
    [ -f "$blob" ] || continue
    name=${blob##*/}
    case $name in
      *.lock) ;;
      *.incomplete)
        held=0  # a lock file nobody made is nobody's (and a reading makes none)
        lock=$repo/blobs/${name%.incomplete}.lock
        [ ! -e "$lock" ] || flock -n "$lock" true 2>/dev/null || held=1
        printf '@partial %s %s %s\n' "$name" "$(stat -c %s "$blob")" "$held" ;;
      *) printf '@blob %s %s\n' "$name" "$(stat -c %s "$blob")" ;;
    esac
  done
done
