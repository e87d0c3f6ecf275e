"""weights: the model in the host's HF cache, complete and verified, fetched by
the host's curl (download.py: resumable, hashed as it streams, no image needed,
so it runs while the image is pulled)."""
from __future__ import annotations

from converge.changes import Command, Output, Produced, Role
from converge.errors import StepFailed

from serving.relay_probe import relay_steps, usable_relay
from serving.fleet import is_serving
from serving.handoffs import CHOICE
from serving.replicas import Served
from converge.secrets import read_optional_secret as read_secret
from serving.serving_host import restart

from .cache import HfCache, status
from .download import Manifest, fetch_script, manifest_script, parse_fetch, parse_manifest, progress_reader



def manifest_of(model: str) -> Output:
    """The file list of one model, as its manifest step produces it."""
    return Output(f"the file list of {model}", Manifest)

DEFAULT_ENDPOINT = "https://huggingface.co"


def facts(hostvars):
    return {"weights": HfCache(hostvars.get("model_cache", "/srv/models/hf-cache"))}


def _mib(n: int) -> str:
    return f"{n / 1024 / 1024:,.0f} MiB" if n >= 1024 * 1024 else f"{n / 1024:,.0f} KiB"


def plan(ctx):
    """Every model the host's replicas serve (mixed GPUs may serve more than one)."""
    served = [Served.of(ctx.vars, placed) for placed in ctx.results[CHOICE].replicas]
    relayed = False
    for model in dict.fromkeys(s.model for s in served):
        # new weights restart the replicas that serve them
        restarts = tuple(restart(s.replica.unit) for s in served if s.model == model)
        relayed = yield from _model(ctx, model, restarts, relayed)


def _model(ctx, model: str, restarts: tuple, relayed: bool):
    """One model's steps; returns whether the run's relay has been probed (once per host)."""
    v = ctx.vars
    revision = v.get("model_revision", "main")
    cache = v.get("model_cache", "/srv/models/hf-cache")
    endpoint = v.get("hf_endpoint") or DEFAULT_ENDPOINT
    complete, why = status(ctx.facts["weights"], model, revision)
    if complete:
        yield Command(f"download {model}", when=False, describe=f"{model} in {cache} ({why})")
        return relayed
    token = read_secret(v.get("hf_token_file"), "hf_token_file", ctx.name)

    def read_manifest(result):
        manifest = parse_manifest(result.stdout, model, revision, endpoint)
        return Produced(manifest, f"{model}@{manifest.commit[:12]}: {len(manifest.files)} files, "
                                  f"{_mib(manifest.total)}")

    # read-only: it runs in check mode too, so that --check says what a download would fetch
    yield Command(f"manifest of {model}", script=manifest_script(endpoint, model, revision, token),
                  describe=f"ask {endpoint} for the files of {model}@{revision}", changes=False, probe=True,
                  timeout=300, interpret=read_manifest, produces=manifest_of(model))
    manifest = ctx.results[manifest_of(model)]
    if not relayed:
        yield from relay_steps(ctx)
    relay = usable_relay(ctx)

    interpret = read_fetch(model, manifest, cache, endpoint, relayed_through=bool(relay), host=ctx.name)

    yield Command(f"download {model}", script=fetch_script(cache, manifest, endpoint, token,
                                                           relay=relay.url if relay else None,
                                                           stall_s=int(v.get("download_stall_s", 20))),
                  describe=f"fetch {model} into {cache} ({why}): {len(manifest.files)} files, {_mib(manifest.total)}",
                  progress=progress_reader(manifest.total), timeout=v.get("weights_timeout", 7200),
                  interpret=interpret, notify=restarts)
    return True



def read_fetch(model: str, manifest: Manifest, cache: str, endpoint: str, relayed_through: bool, host: str = "HOST"):
    """The download step's reader: what the fetch's result and markers (download.FETCH) say of it, or
    StepFailed saying what to do."""
    def interpret(result):
        output = (result.stdout + result.stderr).strip()
        seen = parse_fetch(result.stdout)
        said = seen["result"] or {}
        if said.get("outcome") == "no-space":
            raise StepFailed(f"{cache} has {_mib(int(said['free']))} free; {model} needs {_mib(int(said['need']))} "
                             f"more: free space there (invoke prune --hosts {host} --check shows what the fleet's old images and "
                             f"weights take) or set model_cache to a larger disk (nothing was fetched)")
        if said.get("outcome") == "no-folder":
            raise StepFailed(f"{model}'s folders in {cache} could not be made: {output[-300:] or 'mkdir failed'}. "
                             f"Check that model_cache is a folder the deploy may write (its owner, its mount)")
        if said.get("outcome") != "complete" or str(said.get("commit")) != manifest.commit:
            if "No space left on device" in output:
                raise StepFailed(f"downloading {model} failed: the disk under {cache} is full (No space left on "
                                 f"device). Free space there (invoke prune --hosts {host} --check shows what the "
                                 f"fleet's old images and weights take), or set model_cache to a larger disk, and "
                                 f"deploy again: "
                                 f"what was downloaded is kept and the download resumes")
            if not said:
                raise StepFailed(f"downloading {model} was cut off before it said how it ended (exit {result.rc}, no "
                                 f"result line): {output[-300:] or 'nothing printed'}. What came is kept: the next "
                                 f"deploy resumes it")
            if seen["busy"]:
                raise StepFailed(f"downloading {model}: another download on this host kept blob(s) "
                                 f"{', '.join(b[:12] for b in seen['busy'])} locked for 15 minutes (a run cut off "
                                 f"earlier still fetching them?): deploy again once it is done; what came is kept")
            if seen["partial"]:
                blob, now, size, _, *error = seen["partial"][-1].split(" ", 4) + [""]
                what = (f"blob {blob[:12]} stopped at {_mib(int(now))} of {_mib(int(size))}: "
                        f"{' '.join(error).strip() or 'the connection ended'}")
            else:
                what = output[-400:] or "nothing printed"
            given_up = (f" ({len(seen['failed'])} of {len(manifest.files)} files given up after their tries: "
                        f"{', '.join(b[:12] for b in seen['failed'])})" if seen["failed"] else "")
            raise StepFailed(f"downloading {model} failed (exit {result.rc}){given_up}: {what}. What came is kept: "
                             f"the next deploy resumes it. Check {endpoint} and the host's network")
        again = (f"; {len(seen['corrupt'])} blob(s) failed their sha256 check ({', '.join(b[:12] for b in seen['corrupt'])})"
                 f" and were deleted and fetched again" if seen["corrupt"] else "")
        via = (" through the run's relay" if relayed_through and not seen["relay_failed"] else
               "; the relay failed, fetched from the hub itself" if relayed_through else "")
        return f"{model}@{manifest.commit[:12]} complete and verified in {cache} ({_mib(manifest.total)}){via}{again}"
    return interpret


ROLE = Role("weights", facts, plan, overlaps=True, hosts=is_serving)  # beside the image pull
