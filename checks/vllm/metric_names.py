"""What vLLM 0.33.0's /metrics can export, read from its wheel (no import: the wheel is a zip):
every ``vllm:`` family name its metric loggers create (vllm/v1/metrics/*.py and
vllm/v1/spec_decode/metrics.py), and the diffusion counters in detail (SpecDecodingProm's
``counter_specs`` under ``is_diffusion``: name, help; their type, Counter; their labels, the
stat logger's ``labelnames``). Writes the JSON the stand-in's test reads
(lab/stubs/vllm-metrics.json).

Usage: python3 checks/vllm/metric_names.py vllm-0.33.0-*.whl > lab/stubs/vllm-metrics.json
(checks/vllm/run.sh downloads the wheel into .venv-vllm/wheels)."""
from __future__ import annotations

import ast
import json
import re
import sys
import zipfile

LOGGERS = "vllm/v1/metrics/"
SPEC_DECODE = "vllm/v1/spec_decode/metrics.py"
NAME = re.compile(r'"(vllm:[a-z0-9_]+)"')


def diffusion_counters(source: str) -> list[dict]:
    """The (name, help) tuples of the diffusion branch of SpecDecodingProm.__init__."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Tuple) and len(node.elts) == 2 and all(isinstance(e, ast.Constant) for e in node.elts):
            name, doc = (e.value for e in node.elts)
            if isinstance(name, str) and name.startswith("vllm:diffusion_"):
                found.append({"name": name, "help": doc})
    return found


def labelnames(source: str) -> list[str]:
    """The stat logger's ``labelnames = [...]`` (vllm/v1/metrics/loggers.py)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "labelnames" for t in node.targets):
            if isinstance(node.value, ast.List):
                return [e.value for e in node.value.elts]
    raise SystemExit("no labelnames = [...] in vllm/v1/metrics/loggers.py")


def main(wheel_path: str) -> dict:
    with zipfile.ZipFile(wheel_path) as wheel:
        version = next(n for n in wheel.namelist() if n.endswith(".dist-info/METADATA")).split("-")[1].split(".dist")[0]
        sources = {n: wheel.read(n).decode() for n in wheel.namelist()
                   if (n.startswith(LOGGERS) and n.endswith(".py")) or n == SPEC_DECODE}
    names = sorted({m for text in sources.values() for m in NAME.findall(text)})
    labels = labelnames(sources[LOGGERS + "loggers.py"])
    counters = [{**c, "type": "counter", "labels": labels} for c in diffusion_counters(sources[SPEC_DECODE])]
    return {"vllm": version, "read_from": [LOGGERS + "*.py", SPEC_DECODE], "families": names,
            "diffusion_counters": counters}


if __name__ == "__main__":
    json.dump(main(sys.argv[1]), sys.stdout, indent=2)
    sys.stdout.write("\n")
