# shellcheck shell=dash
# keepalived installed from the host's packages: TOOL is apt-get (the lists refreshed only when
# the package is not found in them) or dnf.
if [ "$TOOL" = apt-get ]; then
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends keepalived ||
    { apt-get update && apt-get install -y --no-install-recommends keepalived; }
else
  dnf install -y keepalived
fi
