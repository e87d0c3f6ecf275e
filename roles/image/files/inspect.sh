# A local image as verify checks it (roles/image/tests): its registry digest and arch.
# Parameters: RUNTIME, REF. Result: digest (empty: none known), arch.
set -e
inspect_image "$REF"
printf '@result {"digest": "%s", "arch": "%s"}\n' "$digest" "$arch"
