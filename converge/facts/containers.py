"""Container runtimes: versions, GPU access, local images."""
from __future__ import annotations

import json
import re
import shlex

from . import Fact


class Runtimes(Fact):
    """podman and docker: installed, version, and how they reach the GPU.

    docker reaches GPUs through the nvidia runtime (``docker info`` lists it);
    podman through a CDI spec naming ``nvidia.com/gpu`` in /etc/cdi or /var/run/cdi.
    """

    command = r"""
if command -v podman >/dev/null 2>&1; then echo "@podman $(podman --version 2>&1)"; fi
if command -v docker >/dev/null 2>&1; then
  echo "@docker $(docker --version 2>&1)"
  echo "@docker-runtimes $(timeout 10 docker info --format '{{json .Runtimes}}' 2>/dev/null || echo unreachable)"
fi
for f in /etc/cdi/*.yaml /etc/cdi/*.json /var/run/cdi/*.yaml /var/run/cdi/*.json; do
  [ -f "$f" ] && grep -q 'nvidia.com/gpu' "$f" && echo "@cdi $f"
done
true
"""

    def process(self, output, rc):
        return parse_runtimes(output)


def parse_runtimes(text: str) -> dict:
    out = {"podman": None, "docker": None, "cdi_specs": []}
    for line in text.splitlines():
        if line.startswith("@podman "):
            m = re.search(r"(\d+\.\d+(?:\.\d+)?)", line)
            out["podman"] = {"version": m.group(1) if m else None}
        elif line.startswith("@docker "):
            m = re.search(r"(\d+\.\d+(?:\.\d+)?)", line)
            out["docker"] = {"version": m.group(1) if m else None, "runtimes": [], "daemon": False}
        elif line.startswith("@docker-runtimes ") and out["docker"] is not None:
            raw = line.split(" ", 1)[1].strip()
            if raw != "unreachable":
                try:
                    out["docker"]["runtimes"] = sorted(json.loads(raw) or {})
                    out["docker"]["daemon"] = True
                except json.JSONDecodeError:
                    pass
        elif line.startswith("@cdi "):
            out["cdi_specs"].append(line.split(" ", 1)[1])
    return out


class Images(Fact):
    """Every local image of a runtime: tags, digest, arch."""

    def __init__(self, runtime: str):
        if runtime not in ("podman", "docker"):
            raise ValueError(runtime)
        self.runtime = runtime
        rt = shlex.quote(runtime)
        fmt = "{{.Id}}\t{{.Architecture}}\t{{json .RepoTags}}\t{{json .RepoDigests}}"
        self.command = (f"command -v {rt} >/dev/null 2>&1 || {{ echo '@absent'; exit 0; }}; "
                        f"ids=$({rt} images -q --no-trunc 2>/dev/null | sort -u); "
                        f"[ -z \"$ids\" ] || {rt} image inspect --format {shlex.quote(fmt)} $ids")

    def process(self, output, rc):
        return parse_images(output)


def parse_images(text: str) -> list[dict] | None:
    if text.strip() == "@absent":
        return None
    images = []
    for line in text.splitlines():
        cells = line.split("\t")
        if len(cells) != 4:
            continue
        tags = json.loads(cells[2]) or []
        digests = json.loads(cells[3]) or []
        images.append({"id": cells[0], "arch": cells[1], "tags": tags, "repo_digests": digests,
                       "digests": sorted({d.split("@", 1)[1] for d in digests if "@" in d})})
    return images


def normalise_ref(ref: str) -> str:
    """``vllm/vllm-openai:tag`` as podman lists it: ``docker.io/vllm/vllm-openai:tag``."""
    name, _, tag = ref.rpartition(":") if ":" in ref.rsplit("/", 1)[-1] else (ref, "", "latest")
    first = name.split("/", 1)[0]
    if "/" not in name:
        name = "docker.io/library/" + name
    elif "." not in first and ":" not in first and first != "localhost":
        name = "docker.io/" + name
    return f"{name}:{tag}"


def find_image(images: list[dict] | None, ref: str) -> dict | None:
    want = normalise_ref(ref)
    for image in images or []:
        if any(normalise_ref(t) == want for t in image["tags"]):
            return image
    return None
