"""How much an image pull will write, read from its registry's manifests before the pull (files/
manifest.sh asks; this reads). Pure.

A tag names an index (one manifest per platform) or a manifest; a manifest lists its layers with
their compressed sizes. A pull writes each layer twice for a while (the download, then the layer
unpacked, which is larger): the image role asks for ``pull_room_factor`` times the compressed
sum, and keeps ``min_free_disk_mib`` free besides."""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import NamedTuple

from converge.facts.containers import normalise_ref
from serving.host_programs import ProgramResultError, decoded

INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
MANIFEST_TYPES = ("application/vnd.oci.image.manifest.v1+json", "application/vnd.docker.distribution.manifest.v2+json")
DOCKER_HUB = "registry-1.docker.io"  # where docker.io's API answers


class Located(NamedTuple):
    registry: str
    repository: str
    reference: str  # a tag or a digest


def locate(ref: str) -> Located:
    """``vllm/vllm-openai:v1`` -> registry-1.docker.io, vllm/vllm-openai, v1; a digest reference keeps its digest."""
    name, _, digest = ref.partition("@")
    full = normalise_ref(name) if not digest else normalise_ref(name + ":latest")
    path, _, tag = full.rpartition(":")
    registry, _, repository = path.partition("/")
    return Located(DOCKER_HUB if registry == "docker.io" else registry, repository, digest or tag)


@dataclass(frozen=True)
class Answer:
    """What a manifest said: ``platform_digest`` to ask next (an index), or ``size`` (a manifest's
    layers and config, compressed bytes), or ``unknown`` (why the size cannot be known)."""
    platform_digest: str | None = None
    size: int | None = None
    unknown: str | None = None


def read_answer(said: dict, arch: str) -> Answer:
    """The manifest program's result for a host of ``arch`` (amd64, arm64)."""
    status = str(said.get("status"))
    if status != "200":
        why = said.get("why") or ""
        return Answer(unknown=f"the registry answered {status}{': ' + why if why and status == 'error' else ''}")
    try:
        doc = json.loads(decoded(said.get("body", ""), "the manifest"))
    except (ProgramResultError, ValueError) as exc:
        return Answer(unknown=f"its manifest could not be read ({exc})")
    kind = str(said.get("type") or doc.get("mediaType") or "").split(";")[0].strip()
    if kind in INDEX_TYPES or "manifests" in doc:
        for entry in doc.get("manifests") or []:
            platform = entry.get("platform") or {}
            if platform.get("architecture") == arch and platform.get("os", "linux") == "linux":
                return Answer(platform_digest=entry.get("digest"))
        listed = sorted({(e.get("platform") or {}).get("architecture", "?") for e in doc.get("manifests") or []})
        return Answer(unknown=f"its index lists no {arch} image (it has {', '.join(listed) or 'none'})")
    if kind in MANIFEST_TYPES or "layers" in doc:
        layers = doc.get("layers") or []
        sizes = [e.get("size") for e in layers + [doc.get("config") or {}]]
        if not layers or not all(isinstance(s, int) and s >= 0 for s in sizes):
            return Answer(unknown="its manifest gives no layer sizes")
        return Answer(size=sum(sizes))
    return Answer(unknown=f"its registry sent a {kind or 'document'} this toolkit does not read")
