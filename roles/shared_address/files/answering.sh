# shellcheck shell=dash
# After systemd.sh: until the gateways' shared address answers https (any HTTP status), whichever
# gateway holds it; asked by the address itself, which every gateway's certificate names (the
# holder may be another gateway). Its result: state (answers, or silent: not in time), the HTTP
# code, whether this gateway holds the address. Parameters: SHARED (the address), URL, CA_FILE,
# TIMEOUT_S.
end=$(( $(date +%s) + TIMEOUT_S ))
while :; do
  code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 2 --cacert "$CA_FILE" "$URL")
  if [ "$code" != 000 ]; then
    holder=no
    if ip -o -4 addr show | grep -qF " $SHARED/"; then holder=yes; fi
    result state=answers code="$code" holder="$holder"; exit 0
  fi
  if [ "$(date +%s)" -ge "$end" ]; then result state=silent code=0 holder=no; exit "$EXIT_SILENT"; fi
  sleep 0.5
done
