"""What the fleet left on a host's disk and no longer needs, and the steps that remove it: `invoke
prune` (day2/prune.py), and the image role before a pull that would not fit (``prune_before_pull``).

What may go (`select`, pure):
- images of the fleet's repositories (the catalog's vLLM repository, and every repository the
  host's release history names) that no container uses, no replica's current release names and
  that are not among the ``keep`` newest earlier releases (serving/releases.py: the rollback
  target and those before it). An image with a tag of another repository too is not the fleet's
  alone: it stays.
- snapshots of the models the release history names whose commit no kept release needs, with
  the blobs only they link; the ``.incomplete`` blobs no download holds; what a prune cut short
  left (a ``.dgemma-pruning-*`` folder, blobs no snapshot links).
Never anything else: another repository's image, another model in the cache, the user's files.

Each removal is one step (files/prune.sh), whole or not at all; ``--check`` shows the steps and
the space each frees, and runs none. What an image frees is the runtime's own count of the space
it alone holds (``podman system df``, the Engine API's ``/system/df``): layers it shares with an
image that stays are not counted."""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from converge.changes import Command, atomic_write_script
from converge.errors import StepFailed
from converge.facts import Fact, FactError
from converge.facts.containers import DOCKER_SOCKET, LIBRARY as CONTAINERS_LIBRARY, Images, normalise_ref
from converge.facts.host import Arch, FileState

from serving import catalog
from serving.hf_cache import model_of, model_path
from serving.host_programs import RESULT_LIBRARY, Program, ProgramResultError, Protocol
from serving.exporter_containers import TEXTFILES
from serving.releases import Release, history_path, kept, parse_history
from serving.serving_host import record_path

FILES = Path(__file__).parent / "files"
FACTS = Protocol("what prune weighs", markers={
    "podman-df": "what follows is `podman system df -v`'s images", "docker-df": "JSON: the Engine API's /system/df",
    "model": "FOLDER: a model's folder; what follows is its own", "ref": "NAME COMMIT",
    "snapshot": "COMMIT BLOB...: the blobs its files link", "blob": "NAME BYTES",
    "partial": "NAME BYTES HELD: an .incomplete blob (HELD 1: a download holds its lock)",
    "trash": "NAME: a snapshot folder a prune cut short"})
# with the engine's library of container facts before it (the fact's library): its docker_api
FACTS_PROGRAM = Program((FILES / "prune_facts.sh",), FACTS)
REMOVE = Protocol("prune", result={"removed": "what went, blank-separated",
                                   "kept": "what stayed, each WHAT:WHY, blank-separated"})
REMOVE_PROGRAM = Program((RESULT_LIBRARY, FILES / "prune.sh"), REMOVE)
DEFAULT_CACHE = "/srv/models/hf-cache"
DEFAULT_KEEP = 1
# go-units' HumanSize, as podman prints sizes: decimal units, four significant digits
_HUMAN = re.compile(r"^([0-9.]+)\s*([kMGTP]?B)$")
_UNITS = {"B": 1, "kB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12, "PB": 10 ** 15}


def human_bytes(text: str) -> int | None:
    match = _HUMAN.match(text.strip())
    return round(float(match.group(1)) * _UNITS[match.group(2)]) if match else None


def size_text(n: int) -> str:
    for unit, scale in (("GB", 10 ** 9), ("MB", 10 ** 6), ("kB", 10 ** 3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


class PruneFacts(Fact):
    """The images' space (id -> size, unique, containers) and the history's models in the cache."""

    def __init__(self, v: dict):
        self.library = CONTAINERS_LIBRARY
        self.command = FACTS_PROGRAM.script({
            "RUNTIME": v.get("container_runtime", "podman"), "DOCKER_SOCKET": DOCKER_SOCKET,
            "HUB": v.get("model_cache", DEFAULT_CACHE).rstrip("/") + "/hub", "HISTORY": history_path(v)})

    def process(self, output, rc):
        try:
            return parse_prune_facts(output)
        except (ValueError, KeyError, TypeError) as exc:
            raise FactError(f"what prune weighs could not be read: {exc}") from None


def parse_prune_facts(text: str) -> dict:
    space: dict = {}
    models: dict = {}
    model = None
    in_podman = False
    for line in text.splitlines():
        word, _, rest = line.partition(" ")
        if word == "@podman-df":
            in_podman = True
            continue
        if word == "@docker-df":
            in_podman = False
            for image in json.loads(rest or "{}").get("Images") or []:
                size, shared = int(image.get("Size") or 0), int(image.get("SharedSize") or 0)
                space[image["Id"].removeprefix("sha256:")] = {
                    "size": size, "unique": size - max(shared, 0), "containers": max(int(image.get("Containers") or 0), 0)}
            continue
        if word.startswith("@"):
            in_podman = False
        if in_podman:
            cells = line.split()
            # REPOSITORY TAG IMAGE-ID CREATED... SIZE SHARED UNIQUE CONTAINERS
            if len(cells) >= 8 and cells[-1].isdigit() and re.fullmatch(r"[0-9a-f]{12}", cells[2]):
                size, unique = human_bytes(cells[-4]), human_bytes(cells[-2])
                if size is not None and unique is not None:
                    space[cells[2]] = {"size": size, "unique": unique, "containers": int(cells[-1])}
            continue
        if word == "@model":
            name = model_of(rest.strip())
            model = models[name] = {"refs": {}, "snapshots": {}, "blobs": {}, "partials": {}, "trash": []}
        elif model is None:
            continue
        elif word == "@ref":
            ref, commit = rest.split()
            model["refs"][ref] = commit
        elif word == "@snapshot":
            commit, *blobs = rest.split()
            model["snapshots"][commit] = blobs
        elif word == "@blob":
            name, size = rest.split()
            model["blobs"][name] = int(size)
        elif word == "@partial":
            name, size, held = rest.split()
            model["partials"][name] = {"size": int(size), "held": held == "1"}
        elif word == "@trash":
            model["trash"].append(rest.strip())
    return {"space": space, "models": models}


def image_space(space: dict, image_id: str) -> dict:
    """The runtime's count for an image (podman's rows name it by 12 digits)."""
    bare = image_id.removeprefix("sha256:")
    return space.get(bare) or space.get(bare[:12]) or {}


def repository(ref: str) -> str:
    """``10.213.0.1:5000/vllm/vllm-openai:tag`` -> ``vllm/vllm-openai``: the repository, whichever
    registry or mirror served it."""
    return normalise_ref(ref.split("@", 1)[0]).rsplit(":", 1)[0].split("/", 1)[1]


@dataclass
class Removal:
    kind: str  # image, snapshot, partial, trash
    what: str  # an image's tag (or id), a model@commit, a model's partial downloads
    size: int  # what it takes
    frees: int  # what removing it frees
    params: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"kind": self.kind, "what": self.what, "size": self.size, "frees": self.frees}


@dataclass
class Selection:
    remove: list
    keep: list  # (what, why)
    images_bytes: int = 0  # the fleet's images here, each as the runtime sizes it (shared layers in each)
    weights_bytes: int = 0  # the blobs and unfinished downloads of the models the history names


def disk_textfile(chosen: Selection, removed: bool = False) -> str:
    """The node exporter's textfile of the fleet's disk (roles/exporters writes it at each deploy,
    invoke prune after it removed): what the fleet's images and weights take, and what prune would
    free. ``removed``: the figures once every removal of ``chosen`` is done."""
    gone = {kind: sum(r.frees for r in chosen.remove if (r.kind == "image") == (kind == "images"))
            for kind in ("images", "weights")}
    taken = {"images": chosen.images_bytes, "weights": chosen.weights_bytes}
    lines = ["# HELP dgemma_fleet_disk_bytes Space the fleet's images (each as its runtime sizes it) and weights "
             "(the blobs of the models deployed here) take on the host.",
             "# TYPE dgemma_fleet_disk_bytes gauge"]
    lines += [f'dgemma_fleet_disk_bytes{{kind="{kind}"}} {max(taken[kind] - (gone[kind] if removed else 0), 0)}'
              for kind in ("images", "weights")]
    lines += ["# HELP dgemma_prunable_bytes What invoke prune (keeping the rollback target) would free on the host.",
              "# TYPE dgemma_prunable_bytes gauge"]
    lines += [f'dgemma_prunable_bytes{{kind="{kind}"}} {0 if removed else gone[kind]}' for kind in ("images", "weights")]
    return "\n".join(lines) + "\n"


def _image_name(image: dict) -> str:
    return image["tags"][0] if image["tags"] else (image["repo_digests"] or [image["id"]])[0]


def select(releases: list[Release], images: list[dict], space: dict, models: dict, keep: int, ours: set[str],
           wanted: set[str], cache: str) -> Selection:
    """What prune removes and what it keeps (and why), from the host's facts. ``wanted``: the
    references a deploy may run next (the image record's, the inventory's): their images stay. Pure."""
    staying = kept(releases, keep)
    now = {r.unit: r for r in releases}
    remove, kept_notes = [], []
    images_bytes = weights_bytes = 0
    kept_digests = {r.digest for r in staying if r.digest}
    kept_tags = {normalise_ref(r.image) for r in now.values()} | {normalise_ref(ref) for ref in wanted if ref}
    kept_tags |= {normalise_ref(r.image) for r in staying if not r.digest}
    for image in images:
        refs = image["tags"] or image["repo_digests"]
        if not refs:
            continue  # nobody's name: not ours to judge
        repos = {repository(ref) for ref in refs}
        if not repos <= ours:
            if repos & ours:
                kept_notes.append((_image_name(image), f"also tagged for {', '.join(sorted(repos - ours))}"))
            continue
        seen = image_space(space, image["id"])
        name = _image_name(image)
        if seen.get("containers", 0):
            kept_notes.append((name, "a container uses it"))
        elif set(image["digests"]) & kept_digests:
            kept_notes.append((name, "a kept release"))
        elif {normalise_ref(t) for t in image["tags"]} & kept_tags:
            kept_notes.append((name, "a replica's current image, or the inventory's"))
        else:
            remove.append(Removal("image", name, seen.get("size", 0), seen.get("unique", 0),
                                  {"ID": image["id"], "TAGS": " ".join(image["tags"])}))
        images_bytes += seen.get("size", 0)
    kept_commits = {(r.model, r.commit) for r in staying}
    for model, entry in sorted(models.items()):
        repo = model_path(cache, model)
        weights_bytes += sum(entry["blobs"].values()) + sum(p["size"] for p in entry["partials"].values())
        held = any(p["held"] for p in entry["partials"].values())
        links = entry["snapshots"]
        keep_snaps = {c for c in links if (model, c) in kept_commits}
        # a ref of a kept release's revision keeps what it names (the next deploy reads it)
        keep_snaps |= {c for ref, c in entry["refs"].items() if any(r.model == model and r.revision == ref
                                                                    for r in now.values())}
        kept_blobs = {b for c in keep_snaps for b in links.get(c, [])}
        for commit in keep_snaps & set(links):
            kept_notes.append((f"{model}@{commit[:12]}", "a kept release" if (model, commit) in kept_commits
                               else "its revision's ref names it"))
        going = [c for c in links if c not in keep_snaps]
        for commit in sorted(going):
            others = {b for c in links if c != commit and c not in going for b in links[c]}
            alone = [b for b in links[commit] if b not in others and b not in kept_blobs and b in entry["blobs"]]
            size = sum(entry["blobs"].get(b, 0) for b in links[commit])
            refs = [ref for ref, c in entry["refs"].items() if c == commit]
            remove.append(Removal("snapshot", f"{model}@{commit[:12]}", size, sum(entry["blobs"][b] for b in alone),
                                  {"REPO": repo, "COMMIT": commit, "REFS": " ".join(refs), "BLOBS": " ".join(alone)}))
        linked = {b for blobs in links.values() for b in blobs}
        loose = sorted(b for b in entry["blobs"] if b not in linked)
        if (entry["trash"] or loose) and not held:
            frees = sum(entry["blobs"][b] for b in loose)
            remove.append(Removal("trash", f"{model}: {len(loose)} blob(s) no snapshot links"
                                           f"{', ' + str(len(entry['trash'])) + ' folder(s) a prune cut short' if entry['trash'] else ''}",
                                  frees, frees, {"REPO": repo, "TRASH": " ".join(entry["trash"]), "BLOBS": " ".join(loose)}))
        partial = sorted(name for name, p in entry["partials"].items() if not p["held"])
        if partial:
            frees = sum(entry["partials"][n]["size"] for n in partial)
            remove.append(Removal("partial", f"{model}: {len(partial)} unfinished download(s)", frees, frees,
                                  {"REPO": repo, "BLOBS": " ".join(partial)}))
        if held:
            kept_notes.append((f"{model}: unfinished downloads", "a download is under way"))
    return Selection(remove, kept_notes, images_bytes, weights_bytes)


def inventory_refs(v: dict, arch: str | None) -> set[str]:
    """The images the inventory may deploy on a host of ``arch``: its ``image``, or every tag the
    image catalog lists for the arch (through the ``registry`` mirror), as preflight chooses them."""
    if v.get("image"):
        return {v["image"]}
    cat = catalog.images()
    registry = v.get("registry")
    return {f"{registry.rstrip('/') + '/' if registry else ''}{cat['repository']}:{row['tag']}"
            for rows in cat["channels"].values() for row in rows if row["arch"] == arch}


def fleet_repositories(v: dict, releases: list[Release]) -> set[str]:
    return {catalog.images()["repository"]} | {repository(r.image) for r in releases}


def selection(ctx, keep: int) -> Selection:
    """What prune removes on the host of ``ctx`` (StepFailed when its facts could not be read)."""
    f, v = ctx.facts, ctx.vars
    if f.get("images") is None and "images" in f.errors:
        raise StepFailed(f"the images could not be listed: {f.errors['images']}")
    if "prune_space" in f.errors:
        raise StepFailed(str(f.errors["prune_space"]))
    releases = parse_history((f.get("prune_history") or {}).get("content") or "")
    record = ((f.get("prune_record") or {}).get("content") or "").split("\n")
    seen = f.get("prune_space") or {"space": {}, "models": {}}
    return select(releases, f.get("images") or [], seen["space"], seen["models"], keep,
                  fleet_repositories(v, releases), {record[0]} | inventory_refs(v, f.get("arch")),
                  v.get("model_cache", DEFAULT_CACHE))


def _params(v: dict, removal: Removal) -> dict:
    base = {"KIND": removal.kind, "RUNTIME": v.get("container_runtime", "podman"), "ID": "", "TAGS": "", "REPO": "",
            "COMMIT": "", "REFS": "", "BLOBS": "", "TRASH": ""}
    return {**base, **removal.params}


DISK_TEXTFILE = f"{TEXTFILES}/disk.prom"


def prune_facts(v: dict) -> dict:
    """The facts prune weighs (gathered in the run's one round trip), and the disk textfile as it is."""
    return {"arch": Arch(), "images": Images(v.get("container_runtime", "podman")), "prune_space": PruneFacts(v),
            "prune_history": FileState(history_path(v)), "prune_record": FileState(record_path(v)),
            "disk_textfile": FileState(DISK_TEXTFILE)}


def disk_textfile_step(ctx, chosen: Selection, removed: bool = False) -> Command:
    """The disk textfile written (atomic) when a figure moved. It is monitoring's reading of the host,
    not the host's configuration: writing it is not a change (the figures a deploy reads before it
    pulls move at the next run, which still changes nothing)."""
    content = disk_textfile(chosen, removed)
    current = ctx.facts.get("disk_textfile") or {}
    differs = current.get("sha256") != hashlib.sha256(content.encode()).hexdigest()
    return Command("disk textfile", when=differs, changes=False, timeout=60,
                   script=atomic_write_script(DISK_TEXTFILE, content.encode(), "0644", "root", "root", False),
                   describe=f"write {DISK_TEXTFILE}: the fleet's images and weights, what prune would free")


def removal_commands(ctx, chosen: Selection):
    """A step per removal, each whole or not at all (files/prune.sh)."""
    for removal in chosen.remove:
        def interpret(result, removal=removal):
            try:
                said = REMOVE.result_of(result.stdout)
            except ProgramResultError as exc:
                raise StepFailed(f"removing {removal.what} ended without saying what it removed (exit "
                                 f"{result.rc}): {exc}; run invoke prune --hosts {ctx.name} --check to see what "
                                 f"is left") from None
            went, stayed = str(said["removed"]).split(), str(said["kept"]).split()
            if removal.kind == "image" and stayed:
                raise StepFailed(f"{removal.what} was kept: {' '.join(stayed)}")
            note = f"; kept {', '.join(stayed)}" if stayed else ""
            return (f"removed {removal.what}: {size_text(removal.frees)} freed{note}", bool(went))

        yield Command(f"remove {removal.kind} {removal.what}", script=REMOVE_PROGRAM.script(_params(ctx.vars, removal)),
                      describe=f"remove {removal.what} ({removal.kind}: {size_text(removal.size)}, frees "
                               f"{size_text(removal.frees)})", timeout=600, interpret=interpret)
