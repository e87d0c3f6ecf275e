# shellcheck shell=dash
# Folders made where they are missing (serving/systemd.py folders_script): FOLDERS, a folder a line,
# "MODE OWNER GROUP PATH" (made with that mode and owner) or "- - - PATH" (made as mkdir -p makes
# it; one already there is left as it is). Exits 1 when one could not be made.
printf '%s\n' "$FOLDERS" | {
  failed=0
  while read -r mode owner group path; do
    [ -n "$path" ] || continue
    if [ "$mode" = - ]; then
      mkdir -p "$path" || failed=1
    else
      install -d -m "$mode" -o "$owner" -g "$group" "$path" || failed=1
    fi
  done
  exit $failed
}
