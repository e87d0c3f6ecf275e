# shellcheck shell=dash
# What the image role knows of a local image (roles/image/role.py): its registry digest and its
# arch. RUNTIME: podman or docker.

# the registry digest of the local image $1: podman keeps it as .Digest; docker only in
# .RepoDigests (repo@sha256:..., one per repository it was pulled from, with docker.io and
# library/ left out of the name): the one of $1's repository
registry_digest() {
  if [ "$RUNTIME" = podman ]; then
    podman image inspect --format '{{.Digest}}' "$1"
    return
  fi
  repo=${1%:*}
  short=${repo#docker.io/}
  short=${short#library/}
  docker image inspect --format '{{range .RepoDigests}}{{println .}}{{end}}' "$1" | while read -r rd; do
    case "${rd%@*}" in
      "$repo" | "$short" | "docker.io/$short") echo "${rd#*@}"; break ;;
    esac
  done
}
# the arch the local image $1 is built for (amd64, arm64)
image_arch() { "$RUNTIME" image inspect --format '{{.Architecture}}' "$1"; }
