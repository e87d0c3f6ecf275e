# A local image as verify checks it (roles/image/tests): its registry digest and arch.
# Parameters: RUNTIME, REF. Result: digest (empty: none known), arch.
set -e
found=$(arch_and_digest "$REF")
a=${found%% *}
d=${found#"$a"}
d=${d# }
printf '@result {"digest": "%s", "arch": "%s"}\n' "$d" "$a"
