"""weights: the model in the host's HF cache, complete and verified, fetched by
the image's own ``hf download`` so the host needs no Python."""
from __future__ import annotations

import shlex

from converge.changes import Command, Role
from converge.errors import StepFailed

from .cache import HfCache, status, verify_script

from roles.service.container import CONTAINER_CACHE


def facts(hostvars):
    return {"weights": HfCache(hostvars.get("model_cache", "/srv/models/hf-cache"))}


def download_command(v: dict, image: str, model: str, env_file: str | None) -> list[str]:
    """The ``hf download`` run inside the vLLM image (argument list; quoted by the caller)."""
    runtime = v.get("container_runtime", "podman")
    cmd = [runtime, "run", "--rm", "--network=host", "--entrypoint", "hf",
           "-v", f"{v.get('model_cache', '/srv/models/hf-cache')}:{CONTAINER_CACHE}",
           "-e", "HF_HUB_DISABLE_XET=1", "-e", "HF_HUB_DISABLE_TELEMETRY=1"]
    if v.get("hf_endpoint"):
        cmd += ["-e", f"HF_ENDPOINT={v['hf_endpoint']}"]
    if env_file:
        cmd += ["--env-file", env_file]  # HF_TOKEN, from a 0600 file: never on a command line
    cmd += [image, "download", model, "--revision", v.get("model_revision", "main")]
    return cmd


def plan(ctx):
    v = ctx.vars
    model = ctx.desired["model"]
    cache = v.get("model_cache", "/srv/models/hf-cache")
    complete, why = status(ctx.facts["weights"], model, v.get("model_revision", "main"))
    env_file = ctx.desired.get("env_file") if ctx.desired.get("hf_token") else None
    cmd = " ".join(shlex.quote(a) for a in download_command(v, ctx.desired["image"], model, env_file))
    script = (f"set -e\nmkdir -p {shlex.quote(cache)}\n"
              # a verification that failed removed the bad blob: download again, once
              f"{cmd}\n( {verify_script(cache, model)} ) || {{ {cmd}; ( {verify_script(cache, model)} ); }}\n")

    def interpret(result):
        if result.rc != 0:
            raise StepFailed(f"downloading {model} failed (exit {result.rc}): "
                             f"{(result.stdout + result.stderr).strip()[-600:]}. The download resumes where it "
                             f"stopped: check {v.get('hf_endpoint') or 'huggingface.co'} and deploy again")
        return f"{model} complete and verified in {cache}"

    yield Command(f"download {model}", script=script, when=not complete,
                  describe=f"hf download {model} into {cache} ({why})", progress=True,
                  timeout=v.get("weights_timeout", 7200), interpret=interpret, notify=("restart",))


ROLE = Role("weights", facts, plan)
