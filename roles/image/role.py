"""image: the chosen tag present with the right arch; its digest recorded."""
from __future__ import annotations

from pathlib import Path

from converge.changes import Check, Command, Output, Produced, Role
from converge.errors import StepFailed
from converge.facts.containers import Images, find_image
from converge.facts.host import FileState

from serving.relay_probe import fallback_note, relay_steps, usable_relay

from serving.fleet import is_serving
from serving.handoffs import CHOICE
from serving.host_programs import Program, ProgramResultError, Protocol
from serving.replicas import Served
from serving.serving_host import STATE_DIR, record_path, restart

from serving.host_programs import RESULT_LIBRARY
from serving.prune import DEFAULT_KEEP, removal_commands, selection, size_text
from serving.prune import prune_facts

from .pull_progress import pull_reader
from .registry import Answer, locate, read_answer

ARCH_NAMES = {"x86_64": "amd64", "aarch64": "arm64"}


def facts(hostvars):
    # what prune weighs, only where a short disk is to be pruned before a pull (prune_before_pull)
    return {"images": Images(hostvars.get("container_runtime", "podman")),
            "image_record": FileState(record_path(hostvars)),
            **(prune_facts(hostvars) if hostvars.get("prune_before_pull") else {})}


FILES = Path(__file__).parent / "files"
IMAGE_FACTS = {"digest": "the registry digest of the image (empty: none known)",
               "arch": "the arch it is built for (amd64, arm64)"}
# files/pull.sh: pulled (through the relay or not), its digest and arch recorded
PULL = Protocol("pull and record the image",
                markers={"relay-failed": "the run's relay failed the pull (the lines before say why)"},
                result=IMAGE_FACTS)
PULL_PROGRAM = Program((FILES / "digest.sh", FILES / "pull.sh"), PULL)
# files/inspect.sh: a local image's digest and arch (verify)
INSPECT = Protocol("inspect the image", result=IMAGE_FACTS)
INSPECT_PROGRAM = Program((FILES / "digest.sh", FILES / "inspect.sh"), INSPECT)
# files/manifest.sh: the image's manifest, asked of its registry before a pull (how much it writes)
MANIFEST = Protocol("ask the registry for the image's manifest", result={
    "status": "the registry's HTTP status (error: no answer)", "type": "its Content-Type",
    "body": "the manifest (base64)", "why": "curl's error"})
MANIFEST_PROGRAM = Program((RESULT_LIBRARY, FILES / "manifest.sh"), MANIFEST)
SIZE = Output("what the registry says of the image", Answer)
PLATFORM_SIZE = Output("what the registry says of the host's platform's image", Answer)


def pull_script(runtime: str, ref: str, record: str, pull: bool = True, relayed: str | None = None,
                known: tuple[str, str] | None = None) -> str:
    """Pull (unless ``pull`` is false), then record ref, digest and arch atomically.

    ``relayed``: the same image through the run's relay (podman): pulled from there
    (its digest is the manifest's, wherever it came from), tagged as ``ref``, the
    relay's name dropped; if that fails, pulled from the registry itself. ``known``:
    the digest and arch recorded for the image here (docker): a pull that finds the
    tag where it was leaves the record as it is."""
    return PULL_PROGRAM.script({"RUNTIME": runtime, "REF": ref, "PULL": int(bool(pull)),
                                "RELAYED": relayed if pull and relayed else "", "RECORD": record,
                                "STATE_DIR": STATE_DIR, "KNOWN_DIGEST": known[0] if known else "",
                                "KNOWN_ARCH": known[1] if known else ""})


def restart_all(ctx) -> tuple:
    """The handlers that restart every replica the choice places (a new image serves them all)."""
    return tuple(restart(Served.of(ctx.vars, placed).replica.unit) for placed in ctx.results[CHOICE].replicas)


def plan(ctx):
    v = ctx.vars
    runtime = v.get("container_runtime", "podman")
    ref = ctx.results[CHOICE].image
    images = ctx.facts["images"]
    present = find_image(images, ref)
    want_arch = ARCH_NAMES.get(ctx.facts.get("arch"), ctx.facts.get("arch"))
    pinned = v.get("image_digest")
    record = ctx.facts.get("image_record")
    recorded = (record or {}).get("content", "").split("\n")
    reason = None
    if present is None:
        reason = "not present"
    elif present["arch"] != want_arch:
        reason = f"present but built for {present['arch']}, host is {want_arch}"
    elif pinned and pinned not in present["digests"]:
        reason = f"present with {', '.join(present['digests']) or 'no digest'}, pinned {pinned}"
    elif not present["digests"] or recorded[:2] != [ref, present["digests"][0]]:
        reason = "present; digest not recorded"

    def pulled(result) -> str:
        """The digest the pull recorded (raises StepFailed when it is not the image wanted)."""
        if result.rc != 0:
            raise StepFailed(f"{runtime} pull {ref} failed (exit {result.rc}): "
                             f"{(result.stdout + result.stderr).strip()[-500:]}. Check the registry "
                             f"({v.get('registry') or 'docker.io'}) and the host's network, then deploy again")
        try:
            found = PULL.result_of(result.stdout)
        except ProgramResultError as exc:
            raise StepFailed(f"{ref}: {exc}; deploy again") from None
        digest, arch = found["digest"] or "?", found["arch"]
        if arch != want_arch:
            raise StepFailed(f"{ref} is built for {arch}, this host is {want_arch}: the registry holds the wrong "
                             f"image under this tag, or set image: to the right one")
        if pinned and digest != pinned:
            raise StepFailed(f"{ref} now has digest {digest}, not the pinned {pinned}: update image_digest")
        return digest

    def interpret(result):
        return f"{ref} {pulled(result)}{fallback_note(result.stdout)}"

    if reason == "present; digest not recorded":
        # no pull: the image is right, only the record is missing
        yield Command(f"record {ref}", script=pull_script(runtime, ref, record_path(v), pull=False),
                      describe=f"record the digest of {ref}", interpret=interpret, timeout=120)
        return
    if reason is None and v.get("image_pull") == "always":
        before = recorded[1] if len(recorded) > 1 else None

        def newer(result):
            digest = pulled(result)
            return f"{ref} {digest}", digest != before  # changed only if the tag moved

        # the record is right (reason None): a pull that finds the tag unmoved need not inspect again
        known = (recorded[1], want_arch) if recorded[2:3] == [want_arch] else None
        yield Command(f"pull {ref}", script=pull_script(runtime, ref, record_path(v), known=known),
                      describe=f"{runtime} pull {ref} (image_pull: always)", progress=pull_reader(),
                      timeout=v.get("image_pull_timeout", 3600), interpret=newer, notify=restart_all(ctx),
                      maybe=True, background=True)
        return
    if reason is not None:
        yield from room_steps(ctx, ref, want_arch)
    relayed = None
    if reason is not None and runtime == "podman":  # docker takes mirrors for Docker Hub only: it pulls itself
        yield from relay_steps(ctx)
        relay = usable_relay(ctx)
        relayed = relay.registry_ref(ref) if relay else None
    # in the background: the weights download needs nothing of it and goes on meanwhile
    yield Command(f"pull {ref}", script=pull_script(runtime, ref, record_path(v), relayed=relayed),
                  when=reason is not None,
                  describe=f"{runtime} pull {ref} ({reason})" if reason else ref, progress=pull_reader(),
                  timeout=v.get("image_pull_timeout", 3600), interpret=interpret, notify=restart_all(ctx),
                  background=True)


def _mib(n: float) -> str:
    return f"{n / 1024 / 1024:,.0f} MiB"


def room_steps(ctx, ref: str, arch: str):
    """Before a pull: the image's size from its registry (an index, then the host's platform's
    manifest), against the free space where the runtime keeps images. Short of it, the host fails
    here, before anything is written. A size that cannot be known (a registry that needs a login,
    an unreadable manifest) is said, and the pull goes on: it is the pull's to fail."""
    v = ctx.vars
    where = locate(ref)

    def ask(reference: str, output: Output, describe: str):
        def interpret(result):
            try:
                answer = read_answer(MANIFEST.result_of(result.stdout), arch)
            except ProgramResultError as exc:
                answer = Answer(unknown=str(exc))
            said = (f"{answer.size:,} bytes compressed" if answer.size is not None else
                    f"the {arch} image is {answer.platform_digest}" if answer.platform_digest else
                    f"size unknown: {answer.unknown}")
            return Produced(answer, said)
        return Command(describe, script=MANIFEST_PROGRAM.script({"REGISTRY": where.registry,
                                                                  "REPOSITORY": where.repository,
                                                                  "REFERENCE": reference}),
                       describe=f"ask {where.registry} for the manifest of {where.repository}@{reference}",
                       changes=False, probe=True, timeout=120, interpret=interpret, produces=output)

    yield ask(where.reference, SIZE, f"size of {ref}")
    answer = ctx.results[SIZE]
    if answer.platform_digest:
        yield ask(answer.platform_digest, PLATFORM_SIZE, f"size of {ref} for {arch}")
        answer = ctx.results[PLATFORM_SIZE]
    disk = ctx.facts.get("disk_images")
    if answer.size is None or not disk:
        yield Check("room for the image", ok=True,
                    message=f"not checked: {answer.unknown or 'the free space where images are kept is unknown'}")
        return
    factor = float(v.get("pull_room_factor", 2.5))
    reserve = int(v.get("min_free_disk_mib", 2048))
    need = answer.size * factor + reserve * 1024 * 1024
    free = disk["free_mib"] * 1024 * 1024
    short = need - free
    pruned = ""
    if short > 0 and v.get("prune_before_pull"):
        # prune_before_pull: what invoke prune would remove goes first; what it frees on this disk counts
        try:
            chosen = selection(ctx, DEFAULT_KEEP)
        except StepFailed as exc:
            raise StepFailed(f"{ref} does not fit and prune_before_pull could not weigh what to remove: {exc}") from None
        same_disk = (ctx.facts.get("disk_cache") or {}).get("mount") == disk["mount"]
        freed = sum(r.frees for r in chosen.remove if r.kind == "image" or same_disk)
        yield from removal_commands(ctx, chosen)
        free += freed
        short = need - free
        pruned = f" after prune_before_pull freed {size_text(freed)}"
    yield Check("room for the image", ok=short <= 0, message=(
        f"{_mib(free)} free on {disk['mount']}{pruned}; {ref} needs about {_mib(need)}" if short <= 0 else
        f"{ref} needs about {_mib(need)} on {disk['mount']} ({disk['path']}): {_mib(answer.size)} of layers "
        f"(compressed) x {factor:g} (pull_room_factor: the download and the unpacked layers) + {reserve} MiB kept "
        f"free (min_free_disk_mib); {_mib(free)} are free{pruned}, {_mib(short)} missing. Nothing was pulled. "
        f"invoke prune --hosts {ctx.name} --check shows what the fleet's old images and weights there take and "
        f"what removing them frees; invoke prune --hosts {ctx.name} removes them (the rollback target stays)"))


ROLE = Role("image", facts, plan, hosts=is_serving)
