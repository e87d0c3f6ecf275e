# shellcheck shell=dash
# The engine's facts of a host's GPUs (converge/facts/nvidia.py), a function each, called with its
# fact's arguments. A gathering sends this file once, before the facts that call it.

# nvidia-smi asked for what the roles need, each call bounded by $1 seconds: the query $2, its
# version (its plain output when --version names no CUDA version), the compute apps query $3; each
# section "@query RC", "@version RC", "@apps RC" and what it printed; "@missing" when there is no
# nvidia-smi. The three are asked at once: each call starts NVML again (a second or more where the
# driver is not kept loaded, as on the lab's emulated spark01), and a wedged GPU costs one timeout,
# not three. Only the query's section where it timed out (what follows it would say the same).
# Output goes to files, not a pipe: a wedged nvidia-smi must not hold our pipe open
fact_nvidia_smi() {
  command -v nvidia-smi >/dev/null 2>&1 || { echo '@missing'; return 0; }
  d=$(mktemp -d) || return 1
  # shellcheck disable=SC2086 # the query's options, blank-separated
  (timeout -k 2 "$1" nvidia-smi $2 >"$d/query" 2>&1; echo $? >"$d/query.rc") &
  (
    timeout -k 2 "$1" nvidia-smi --version >"$d/version" 2>&1
    rc=$?
    case $rc in
      124 | 137) ;;  # it timed out: the plain call would hang as long again
      *)
        if [ $rc -ne 0 ] || ! grep -qiE 'CUDA (UMD )?Version' "$d/version"; then
          timeout -k 2 "$1" nvidia-smi >"$d/version" 2>&1
          rc=$?
        fi
        ;;
    esac
    echo $rc >"$d/version.rc"
  ) &
  # shellcheck disable=SC2086 # the query's options, blank-separated
  (timeout -k 2 "$1" nvidia-smi $3 >"$d/apps" 2>&1; echo $? >"$d/apps.rc") &
  wait
  read -r rc <"$d/query.rc"
  echo "@query $rc"; cat "$d/query"
  if [ "$rc" -ne 124 ] && [ "$rc" -ne 137 ]; then
    read -r rc <"$d/version.rc"
    echo "@version $rc"; cat "$d/version"
    read -r rc <"$d/apps.rc"
    echo "@apps $rc"; cat "$d/apps"
  fi
  rm -rf "$d"
}

# whether NVIDIA's DCGM host engine runs (nvidia-dcgm.service, or an nv-hostengine process) and
# where dcgmi is: "dcgmi PATH", "service STATE", "process yes|no"
fact_dcgm() {
  printf 'dcgmi %s\n' "$(command -v dcgmi || echo -)"
  printf 'service %s\n' "$(systemctl is-active nvidia-dcgm.service 2>/dev/null || true)"
  if pgrep -x nv-hostengine >/dev/null 2>&1; then echo 'process yes'; else echo 'process no'; fi
}
