# shellcheck shell=dash
# What the image role knows of a local image (roles/image/role.py): its arch and its registry
# digest. RUNTIME: podman or docker.

# $arch and $digest set to the arch the local image $1 is built for (amd64, arm64) and its
# registry digest (empty: none known), from one inspect (a runtime's CLI takes a second of CPU
# to start on an emulated host); non-zero when the runtime cannot inspect it. podman keeps the
# digest as .Digest; docker only in .RepoDigests (repo@sha256:..., one per repository it was
# pulled from, with docker.io and library/ left out of the name): the one of $1's repository
inspect_image() {
  if [ "$RUNTIME" = podman ]; then
    found=$(podman image inspect --format '{{.Architecture}} {{.Digest}}' "$1") || return
    arch=${found%% *}
    digest=${found#"$arch"}
    digest=${digest# }
    return
  fi
  found=$(docker image inspect --format '{{.Architecture}}{{range .RepoDigests}} {{.}}{{end}}' "$1") || return
  repo=${1%:*}
  short=${repo#docker.io/}
  short=${short#library/}
  arch=${found%% *}
  digest=
  for rd in ${found#"$arch"}; do
    case "${rd%@*}" in
      "$repo" | "$short" | "docker.io/$short") digest=${rd#*@}; break ;;
    esac
  done
}
