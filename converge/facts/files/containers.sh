# shellcheck shell=dash
# The engine's facts of a host's container runtimes (converge/facts/containers.py), a function
# each, called with its fact's arguments. A gathering sends this file once, before the facts that
# call it.

# whether docker's Engine API answers for the daemon the CLI would use, on its socket $1 through
# curl: docker's CLI is a Go program that takes most of a second of CPU to start on an emulated host
# (0.9 s on the lab's spark01, against 0.2 s for curl), and it is asked twice a gathering. Only
# where the CLI would talk to that socket: no DOCKER_HOST or DOCKER_CONTEXT, no context chosen in
# its config; anything else (or no curl) asks the CLI, as before
docker_api_usable() {
  [ -S "$1" ] && [ -z "${DOCKER_HOST:-}" ] && [ -z "${DOCKER_CONTEXT:-}" ] && command -v curl >/dev/null 2>&1 &&
    ! grep -qs '"currentContext"' "${DOCKER_CONFIG:-${HOME:-/root}/.docker}/config.json"
}

# the Engine API's answers on the socket $1 to the paths $2... (several: one curl, one after the
# other); curl's status is the last failed one's
docker_api() {
  sock=$1
  shift
  for path in "$@"; do set -- "$@" "http://localhost$path"; shift; done
  curl -sS --fail --max-time 30 --unix-socket "$sock" "$@"
}

# podman and docker: their versions, docker's runtimes and NVIDIA's hook, the CDI specs that name
# nvidia.com/gpu; each "@name what" a line. docker's version and runtimes come from its Engine API
# on the socket $1 ("@docker-api" and its /info, one line of JSON) where docker_api_usable, else
# from one `docker info` where the daemon answers (its server's version: the CLI takes a second of
# CPU to start on an emulated host), `docker --version` where it does not. A daemon that has not
# answered in 30 s is down or wedged; an answering one takes a second, several on a host busy with
# the facts' other programs (the lab's spark01, emulated on two cores: 12 s for this fact beside
# the others)
fact_runtimes() {
  # its version alone (podman 4.3 under qemu first prints an error of its own about the CPU)
  if command -v podman >/dev/null 2>&1; then echo "@podman $(podman --version 2>/dev/null)"; fi
  if command -v docker >/dev/null 2>&1; then
    if docker_api_usable "$1" && info=$(docker_api "$1" /info 2>/dev/null); then
      printf '@docker-api %s\n' "$info"
    elif info=$(timeout 30 docker info --format '{{.ServerVersion}} {{json .Runtimes}}' 2>/dev/null); then
      echo "@docker ${info%% *}"
      echo "@docker-runtimes ${info#* }"
    else
      echo "@docker $(docker --version 2>&1)"
      echo "@docker-runtimes unreachable"
    fi
    echo "@nvidia-hook $(command -v nvidia-container-runtime-hook || echo -)"
  fi
  for f in /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json; do
    if [ -f "$f" ] && grep -q 'nvidia.com/gpu' "$f"; then echo "@cdi $f"; fi
  done
  true
}

# every local image of the runtime $1 (podman, docker) as FORMAT $2 says, a line each; "@absent"
# when the runtime is not there. docker's, where docker_api_usable on the socket $3: "@docker-api"
# then what its Engine API says of each image (/images/ID/json, a JSON document each), two curls
# instead of two starts of docker's CLI
fact_images() {
  command -v "$1" >/dev/null 2>&1 || { echo '@absent'; return 0; }
  if [ "$1" = docker ] && [ -n "${3:-}" ] && docker_api_usable "$3" && listed=$(docker_api "$3" /images/json 2>/dev/null); then
    echo '@docker-api'
    # each image's "Id" (JSON-escaped values cannot hold '"Id":"'), once
    ids=$(printf '%s' "$listed" | grep -o '"Id"[[:space:]]*:[[:space:]]*"sha256:[0-9a-f]*"' | grep -o 'sha256:[0-9a-f]*' | sort -u)
    # shellcheck disable=SC2046,SC2086 # a path per image id, one word each
    [ -z "$ids" ] || docker_api "$3" $(printf '/images/%s/json ' $ids) 2>/dev/null  # one removed meanwhile: left out
    return 0
  fi
  ids=$("$1" images -q --no-trunc 2>/dev/null | sort -u)
  # shellcheck disable=SC2086 # the image ids, one word each
  [ -z "$ids" ] || "$1" image inspect --format "$2" $ids
}

# whether the runtime $1 has an image tagged $2: "@rc 0" (yes) or "@rc 1" (no), as the runtime says
fact_image_asked() {
  if [ "$1" = podman ]; then podman image exists "$2" >/dev/null 2>&1; else docker image inspect "$2" >/dev/null 2>&1; fi
  echo "@rc $?"
}

# whether podman has an image tagged $1, read from its store's own index ($2/images.json, "$3": the
# tag as the index writes it) where storage.conf sets none of the settings $4 (a regular expression)
# to other than its defaults $5 (blank-separated): "@index 0" (yes), 1 (no), 2 (no index yet);
# anything else asks podman
fact_image_indexed() {
  files=${CONTAINERS_STORAGE_CONF:-/etc/containers/storage.conf /usr/share/containers/storage.conf /etc/containers/storage.conf.d/*.conf}
  # shellcheck disable=SC2086 # storage.conf's files: blank-separated, the last a glob
  conf=$(sed -nE "s/^[[:space:]]*($4)[[:space:]]*=[[:space:]]*/\\1=/p" $files 2>/dev/null)
  fast=yes
  for kv in $conf; do
    case " $5 " in *" $kv "*) ;; *) fast=no ;; esac
  done
  if [ $fast = yes ] && [ -r "$2/images.lock" ]; then
    grep -qsF "$3" "$2/images.json"
    echo "@index $?"
  else
    fact_image_asked podman "$1"
  fi
}
