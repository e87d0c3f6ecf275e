#!/usr/bin/env bash
# The toolkit and the lab against vLLM 0.33.0's own code: every `vllm serve` line the toolkit
# renders (the shipped inventory's and the lab's hosts, each model family, with and without
# generation_defaults) through vLLM's argument parser (parse_serve_lines.py), and the lab's
# stand-in's chat answers through vLLM's request and response models (standin_shapes.py), and the
# metric names the stand-in's test holds it to (metric_names.py).
# Not part of the test suite: it installs vLLM's Python side into .venv-vllm (about 2 GB; torch
# is the CPU build, vLLM's GPU-only requirements are left out: the parser needs none of them).
# Usage: checks/vllm/run.sh [LAB_INVENTORY]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=.venv-vllm
if [ ! -f "$VENV/.installed-0.33.0" ]; then
  rm -rf "$VENV"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check torch==2.13.0
  "$VENV/bin/pip" download -q --no-deps -d "$VENV/wheels" vllm==0.33.0
  wheel=$(ls "$VENV"/wheels/vllm-0.33.0-*.whl)
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps "$wheel"
  # vLLM's own requirements (its wheel's metadata) but the GPU kernels and media codecs
  "$VENV/bin/python" - "$wheel" > "$VENV/requirements.txt" <<'PY'
import re, sys, zipfile
GPU = re.compile(r"^(torch|torchaudio|torchvision|torchcodec|PyNvVideoCodec|flashinfer-python|apache-tvm-ffi|tilelang|"
                 r"nvidia-|nvtx|fastsafetensors|instanttensor|quack-kernels|tokenspeed-mla|humming-kernels|numba)", re.I)
with zipfile.ZipFile(sys.argv[1]) as wheel:
    meta = wheel.read(next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))).decode()
for line in meta.splitlines():
    if line.startswith("Requires-Dist: ") and "extra ==" not in line:
        req = line[len("Requires-Dist: "):]
        if not GPU.match(req):
            print(req)
PY
  "$VENV/bin/pip" install -q --disable-pip-version-check -r "$VENV/requirements.txt"
  touch "$VENV/.installed-0.33.0"
fi
.venv/bin/python checks/vllm/render_serve_lines.py "${1:-/var/lib/dgemma-lab/inventory}" \
  | "$VENV/bin/python" checks/vllm/parse_serve_lines.py
"$VENV/bin/python" checks/vllm/standin_shapes.py 2>&1 | grep -v "^INFO: "
# the metric families the stand-in may export, as the wheel names them (tests/test_vllm_standin_diffusion.py)
python3 checks/vllm/metric_names.py "$(ls "$VENV"/wheels/vllm-0.33.0-*.whl)" | diff - lab/stubs/vllm-metrics.json \
  && echo "lab/stubs/vllm-metrics.json: as vLLM 0.33.0's wheel names them"
