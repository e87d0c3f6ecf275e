"""Container runtimes: versions, GPU access, local images."""
from __future__ import annotations

import json
import re

from . import LIBRARIES, Fact, FactError, call

LIBRARY = LIBRARIES / "containers.sh"
# where docker's CLI finds its daemon when nothing (DOCKER_HOST, a context) says otherwise; the
# facts ask its Engine API there (files/containers.sh: docker_api_usable)
DOCKER_SOCKET = "/var/run/docker.sock"
# what files/containers.sh prints, a marker a line, and what follows each (read by the parsers below)
MARKERS = {
    "podman": "VERSION: `podman --version`", "docker": "VERSION: the daemon's (`docker --version` where it does not answer)",
    "docker-api": "JSON: the Engine API's /info, on one line (runtimes); nothing: its image documents follow (images)",
    "docker-runtimes": "JSON|unreachable: the daemon's runtimes", "nvidia-hook": "PATH|-: NVIDIA's runtime hook",
    "cdi": "PATH: a CDI spec naming nvidia.com/gpu", "absent": "the runtime is not installed",
    "index": "CODE: the store index's answer (0 there, 1 not, 2 no index)", "rc": "CODE: the runtime's answer",
}


class Runtimes(Fact):
    """podman and docker: installed, version, and how they reach the GPU.

    docker reaches GPUs through NVIDIA's container toolkit: ``--gpus`` needs its
    runtime hook on the daemon's PATH, and ``nvidia-ctk runtime configure``
    registers the ``nvidia`` runtime (``docker info`` lists it); podman through a
    CDI spec naming ``nvidia.com/gpu`` in /etc/cdi or /var/run/cdi.
    """

    library, command = LIBRARY, call("fact_runtimes", DOCKER_SOCKET)

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
        elif line.startswith("@docker-api "):
            info = json.loads(line.split(" ", 1)[1])
            m = re.search(r"(\d+\.\d+(?:\.\d+)?)", str(info.get("ServerVersion", "")))
            out["docker"] = {"version": m.group(1) if m else None, "runtimes": sorted(info.get("Runtimes") or {}),
                             "daemon": True}
        elif line.startswith("@docker-runtimes ") and out["docker"] is not None:
            raw = line.split(" ", 1)[1].strip()
            if raw != "unreachable":
                try:
                    out["docker"]["runtimes"] = sorted(json.loads(raw) or {})
                    out["docker"]["daemon"] = True
                except json.JSONDecodeError:
                    pass
        elif line.startswith("@nvidia-hook ") and out["docker"] is not None:
            out["docker"]["nvidia_hook"] = line.split(" ", 1)[1].strip() not in ("-", "")
        elif line.startswith("@cdi "):
            out["cdi_specs"].append(line.split(" ", 1)[1])
    return out


class Images(Fact):
    """Every local image of a runtime: tags, digest, arch."""

    def __init__(self, runtime: str):
        if runtime not in ("podman", "docker"):
            raise ValueError(runtime)
        self.runtime = runtime
        fmt = "{{.Id}}\t{{.Architecture}}\t{{json .RepoTags}}\t{{json .RepoDigests}}"
        self.library = LIBRARY
        self.command = call("fact_images", runtime, fmt, *([DOCKER_SOCKET] if runtime == "docker" else []))

    def process(self, output, rc):
        return parse_images(output)


def parse_images(text: str) -> list[dict] | None:
    if text.strip() == "@absent":
        return None
    head, _, rest = text.partition("\n")
    if head == "@docker-api":
        return _api_images(rest)
    images = []
    for line in text.splitlines():
        cells = line.split("\t")
        if len(cells) != 4:
            continue
        images.append(_image(cells[0], cells[1], json.loads(cells[2]), json.loads(cells[3])))
    return images


def _api_images(text: str) -> list[dict]:
    """The Engine API's documents of images (/images/ID/json), one after another, as the CLI's lines read."""
    decoder, images, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return images
        doc, at = decoder.raw_decode(text, at)
        images.append(_image(doc["Id"], doc.get("Architecture"), doc.get("RepoTags"), doc.get("RepoDigests")))


def _image(image_id: str, arch: str | None, tags: list | None, repo_digests: list | None) -> dict:
    """One local image as the facts give it, whichever way docker or podman was asked."""
    repo_digests = repo_digests or []
    return {"id": image_id, "arch": arch, "tags": tags or [], "repo_digests": repo_digests,
            "digests": sorted({d.split("@", 1)[1] for d in repo_digests if "@" in d})}


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


# What root podman uses when storage.conf says nothing else (containers/storage defaults).
PODMAN_STORE = "/var/lib/containers/storage"
_STORE_SETTINGS = ("driver", "graphroot", "imagestore", "additionalimagestores")
_DEFAULT_SETTINGS = ('driver="overlay"', f'graphroot="{PODMAN_STORE}"', f'graphroot="{PODMAN_STORE}/"',
                     "additionalimagestores=[]")  # a list over several lines is not read: podman is asked
# registry host (with a dot or a port, or localhost) / path : tag -- as the store names it.
# docker.io is left to podman: it names some of its images differently (library/).
_QUALIFIED_REF = re.compile(r"^(?!(index\.)?docker\.io/)(localhost|[a-z0-9-]+(\.[a-z0-9-]+)+|[a-z0-9.-]+:[0-9]+)"
                            r"(:[0-9]+)?/[a-z0-9._/-]+:[A-Za-z0-9._-]+$")


class ImagePresent(Fact):
    """Whether ``runtime`` has a local image under the tag ``ref``.

    podman has no daemon to ask, and starting it costs ~25 ms of CPU on the host:
    for a fully qualified tag in root's default store (storage.conf changes
    neither driver nor root nor adds image stores) the store's own index,
    ``overlay-images/images.json``, is read instead; its ``names`` are what
    ``podman image exists`` looks up. Anything else (or ``read_index=False``) asks podman.
    """

    def __init__(self, runtime: str, ref: str, read_index: bool = True):
        if runtime not in ("podman", "docker"):
            raise ValueError(runtime)
        self.runtime, self.ref = runtime, ref
        self.library = LIBRARY
        if runtime == "docker" or not read_index or not _QUALIFIED_REF.match(ref):
            self.command = call("fact_image_asked", runtime, ref)
            return
        self.command = call("fact_image_indexed", ref, f"{PODMAN_STORE}/overlay-images", json.dumps(ref),
                            "|".join(_STORE_SETTINGS), " ".join(_DEFAULT_SETTINGS))

    def process(self, output, rc):
        word, _, code = output.strip().rpartition("\n")[-1].partition(" ")
        if word not in ("@rc", "@index") or not code.isdigit():
            raise FactError(f"could not tell whether {self.ref} is present: {output.strip()[-200:]}")
        code = int(code)
        if code in (0, 1):
            return code == 0
        if word == "@index" and code == 2:  # no images.json yet: an empty store
            return False
        raise FactError(f"{self.runtime} could not say whether {self.ref} is present (exit {code}); "
                        f"run '{self.runtime} image ls' on the host")
