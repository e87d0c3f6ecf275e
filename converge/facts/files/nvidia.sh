# shellcheck shell=dash
# The engine's facts of a host's GPUs (converge/facts/nvidia.py), a function each, called with its
# fact's arguments. A gathering sends this file once, before the facts that call it.

# nvidia-smi asked for what the roles need, each call bounded by $1 seconds: the query $2, its
# version (its plain output when --version names no CUDA version), the compute apps query $3; each
# section "@query RC", "@version RC", "@apps RC" and what it printed; "@missing" when there is no
# nvidia-smi. Output goes to a file, not a pipe: a wedged nvidia-smi must not hold our pipe open
fact_nvidia_smi() {
  command -v nvidia-smi >/dev/null 2>&1 || { echo '@missing'; return 0; }
  f=$(mktemp)
  # shellcheck disable=SC2086 # the query's options, blank-separated
  timeout -k 2 "$1" nvidia-smi $2 >"$f" 2>&1
  rc=$?
  echo "@query $rc"; cat "$f"
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then rm -f "$f"; return 0; fi
  timeout -k 2 "$1" nvidia-smi --version >"$f" 2>&1
  rc=$?
  if [ $rc -ne 0 ] || ! grep -qiE 'CUDA (UMD )?Version' "$f"; then timeout -k 2 "$1" nvidia-smi >"$f" 2>&1; rc=$?; fi
  echo "@version $rc"; cat "$f"
  # shellcheck disable=SC2086 # the query's options, blank-separated
  timeout -k 2 "$1" nvidia-smi $3 >"$f" 2>&1
  rc=$?
  echo "@apps $rc"; cat "$f"
  rm -f "$f"
}

# whether NVIDIA's DCGM host engine runs (nvidia-dcgm.service, or an nv-hostengine process) and
# where dcgmi is: "dcgmi PATH", "service STATE", "process yes|no"
fact_dcgm() {
  printf 'dcgmi %s\n' "$(command -v dcgmi || echo -)"
  printf 'service %s\n' "$(systemctl is-active nvidia-dcgm.service 2>/dev/null || true)"
  if pgrep -x nv-hostengine >/dev/null 2>&1; then echo 'process yes'; else echo 'process no'; fi
}
