"""Choose the image tag, the model variant and the memory fraction for a host.

Pure functions over facts and variables; each choice comes with the reason, in
words, so that ``invoke facts`` can say why.
"""
from __future__ import annotations

from converge.facts.nvidia import cuda_tuple

from serving import catalog
from serving.handoffs import Choice

from .placement import place_declared
from .variants import Refused, version


def image_channel(hostvars: dict, families: list[str]) -> str:
    """The image channel of a host that serves ``families`` (one image serves every replica of a
    host): ``image_channel`` when set, checked to serve them all, else the first channel of the
    first family that serves every other one too (the catalog's families: channels:)."""
    fams = catalog.models()["families"]
    serving = [fams[f]["channels"] for f in families]
    wanted = hostvars.get("image_channel")
    if wanted:
        lacking = [catalog.models()["families"][f]["title"] for f, ch in zip(families, serving) if wanted not in ch]
        if lacking:
            raise Refused(f"image_channel {wanted}: its vLLM does not serve {', '.join(lacking)} (the model catalog's "
                          f"channels:); leave image_channel unset or pick a channel that serves every model of the host")
        return wanted
    for channel in serving[0]:
        if all(channel in ch for ch in serving):
            return channel
    raise Refused(f"no image channel serves {' and '.join(fams[f]['title'] for f in families)} together: give "
                  f"them GPUs on different hosts")


def choose_image(arch: str, cuda: str | None, hostvars: dict, families: list[str] | None = None) -> tuple[str, str]:
    if hostvars.get("image"):
        return hostvars["image"], "set by the inventory (image)"
    cat = catalog.images()
    channel = image_channel(hostvars, families or ["diffusiongemma"])
    rows = cat["channels"].get(channel)
    if not rows:
        raise Refused(f"image_channel {channel!r} is not in the image catalog (serving/catalog/images.yml); it has "
                      f"{', '.join(cat['channels'])}")
    have = cuda_tuple(cuda)
    if have is None:
        raise Refused(f"the driver's CUDA version is unknown (nvidia-smi printed neither 'CUDA Version' nor 'CUDA UMD Version'): "
                      f"{cat['remedy']}")
    arches = {r["arch"] for r in rows}
    if arch not in arches:
        raise Refused(f"no vLLM image is built for {arch}; the catalog has {', '.join(sorted(arches))}")
    for row in rows:
        if row["arch"] == arch and have >= version(row["min_cuda"]):
            ref = f"{cat['repository']}:{row['tag']}"
            registry = hostvars.get("registry")
            if registry:
                ref = f"{registry.rstrip('/')}/{ref}"
            return ref, (f"{arch} with driver CUDA {cuda} >= {row['min_cuda']} "
                         f"({channel} channel){', through mirror ' + registry if registry else ''}")
    lowest = min(version(r["min_cuda"]) for r in rows if r["arch"] == arch)
    raise Refused(f"the driver supports CUDA {cuda}, older than any {channel} image "
                  f"(CUDA {'.'.join(map(str, lowest))} at least): {cat['remedy']}")


def choose(facts: dict, hostvars: dict, running: dict | None = None) -> Choice:
    """facts: ``arch``, ``nvidia`` (NvidiaSmi), ``meminfo``; ``running``: GPU uuid -> the
    utilization our replica there started with. The first replica's choice is the host's."""
    arch = facts["arch"]
    nvidia = facts["nvidia"]
    placement = place_declared(nvidia, facts["meminfo"], hostvars, running)
    if not placement.replicas:
        raise Refused(_nothing_serves(placement.skipped, len(nvidia["gpus"])))
    families = list(dict.fromkeys(r.family for r in placement.replicas))
    image, image_reason = choose_image(arch, nvidia.get("cuda_version"), hostvars, families)
    return Choice(image, image_reason, placement)


def _nothing_serves(skipped: list, gpus: int) -> str:
    if gpus == 1:
        reason = skipped[0]["reason"]
        if reason.startswith("no DiffusionGemma variant fits"):  # the default family's words (place)
            return (f"not enough GPU memory for any DiffusionGemma variant: {reason.split(': ', 1)[1]}. "
                    f"Free memory on the GPU (stop what holds it) or use a larger GPU.")
        return reason
    return "no GPU of this host can serve: " + "; ".join(f"GPU {s['index']} ({s['uuid']}): {s['reason']}"
                                                         for s in skipped)
