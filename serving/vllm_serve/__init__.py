"""Compose `vllm serve` arguments from variables (DOMAIN.md), and write them
into a systemd unit safely. Pure functions."""
from __future__ import annotations

import json
import re
from functools import lru_cache
from pathlib import Path

from converge.errors import StepFailed
from serving import catalog
from serving.declared import DEFAULT_FAMILY, is_diffusion, served_name, served_names

HERE = Path(__file__).parent


@lru_cache(maxsize=None)
def known_options() -> frozenset:
    """Every option string of `vllm serve` in vLLM 0.33.0 (read from its parser)."""
    return frozenset((HERE / "vllm-serve-options.txt").read_text().split())


def attention_backend(v: dict, family: str) -> str | None:
    """The attention backend a family's replicas are started with: the inventory's, else the
    one its catalog entry needs (DiffusionGemma's bidirectional attention: TRITON_ATTN, seed
    001), else none: vLLM chooses (on Hopper, a faster one than Triton's)."""
    return v.get("attention_backend") or catalog.models()["families"].get(family, {}).get("attention_backend")


def serve_args(v: dict, model: str, utilization: float, tensor_parallel_size: int, port: int,
               family: str = DEFAULT_FAMILY) -> list[str]:
    """``port``: the replica's loopback port (serving/replicas.py); ``family``: the model family
    (its catalog entry says the flags it needs; an autoregressive one takes no diffusion settings)."""
    dumps = lambda obj: json.dumps(obj, separators=(", ", ": "))  # noqa: E731
    args = [model,
            # one name per family on every host, whatever variant it serves (the gateway routes
            # by it); the variant's own name too, so that clients that ask for it still get it
            "--served-model-name", served_name(family, v), model, *served_names(family, v)[1:],
            # loopback only: the front door (roles/frontdoor) is the way in from the network
            "--host", "127.0.0.1", "--port", str(int(port)),
            "--gpu-memory-utilization", f"{utilization:g}",
            "--max-num-seqs", str(v.get("max_num_seqs", 4)),
            "--max-num-batched-tokens", str(v.get("max_num_batched_tokens", 8192))]
    backend = attention_backend(v, family)
    if backend:
        args += ["--attention-backend", backend]
    if is_diffusion(family):
        args += ["--diffusion-config", dumps({"canvas_length": v.get("canvas_length", 256),
                                              "max_denoising_steps": v.get("max_denoising_steps", 48)}),
                 "--hf-overrides", dumps({"diffusion_sampler": v.get("diffusion_sampler", "entropy_bound"),
                                          "diffusion_entropy_bound": v.get("diffusion_entropy_bound", 0.1)})]
    args += ["--enable-auto-tool-choice",
             "--tool-call-parser", v.get("tool_call_parser", "gemma4"),
             "--reasoning-parser", v.get("reasoning_parser", "gemma4"),
             # the family's defaults for requests that set none; max_new_tokens null lifts the
             # checkpoint's 256 (seed 000: answers cut mid-sentence), as vLLM's get_diff_sampling_param reads it
             "--override-generation-config", dumps(generation_wanted(v, family)),
             "--default-chat-template-kwargs", dumps({"enable_thinking": v.get("enable_thinking", True)}),
             "--enable-chunked-prefill"]
    if v.get("force_include_usage", True):
        # streamed answers say what they used, as the gateways count tokens (vLLM's should_include_usage)
        args.append("--enable-force-include-usage")
    if tensor_parallel_size > 1:  # a variant that fits no single GPU here, split over the GPUs it was handed
        args += ["--tensor-parallel-size", str(tensor_parallel_size)]
    if v.get("max_model_len"):
        args += ["--max-model-len", str(v["max_model_len"])]
    if v.get("model_revision", "main") != "main":
        args += ["--revision", v["model_revision"]]
    extra = list(v.get("extra_serve_args") or [])
    if "--enforce-eager" in extra:
        raise StepFailed("extra_serve_args: --enforce-eager disables CUDA graphs and compile (seed 003): remove it")
    args += extra
    check_flags(args)
    return args


# the diffusion settings (DOMAIN.md): two in --diffusion-config, two in --hf-overrides
DIFFUSION_CONFIG = ("canvas_length", "max_denoising_steps")
DIFFUSION_OVERRIDES = ("diffusion_sampler", "diffusion_entropy_bound")


def diffusion_wanted(v: dict) -> dict:
    """The diffusion settings the variables ask for (the roles' defaults filled in)."""
    return {"canvas_length": v.get("canvas_length", 256), "max_denoising_steps": v.get("max_denoising_steps", 48),
            "diffusion_sampler": v.get("diffusion_sampler", "entropy_bound"),
            "diffusion_entropy_bound": v.get("diffusion_entropy_bound", 0.1)}


GENERATION_SETTINGS = ("max_new_tokens", "temperature", "top_p")


def generation_wanted(v: dict, family: str = DEFAULT_FAMILY) -> dict:
    """A family's generation defaults (--override-generation-config): the catalog's for the
    family, the inventory's ``generation_defaults`` for it over them, in a steady order."""
    own = {**(catalog.models()["families"].get(family, {}).get("generation_defaults") or {}),
           **((v.get("generation_defaults") or {}).get(family) or {})}
    return {k: own[k] for k in GENERATION_SETTINGS if k in own}


def json_flags(argv: list[str], flags: tuple) -> list[tuple[str, dict]]:
    """Each (flag, JSON object) of ``flags`` on a command line, in order (``--flag value`` and
    ``--flag=value``); a value that is not a JSON object is passed over, as vLLM would refuse it."""
    out = []
    for i, arg in enumerate(argv):
        flag, sep, value = arg.partition("=")
        if flag not in flags:
            continue
        if not sep:
            if i + 1 >= len(argv):
                continue
            value = argv[i + 1]
        try:
            data = json.loads(value)
        except ValueError:
            continue
        if isinstance(data, dict):
            out.append((flag, data))
    return out


def generation_in_force(argv: list[str]) -> dict | None:
    """The generation defaults a running replica was started with: its command line's last
    --override-generation-config (None: it has none, vLLM's checkpoint defaults)."""
    found = json_flags(argv, ("--override-generation-config",))
    return found[-1][1] if found else None


def diffusion_in_force(argv: list[str]) -> dict | None:
    """The diffusion settings a running replica was started with, from its command line (the
    runtime's `run ... IMAGE MODEL --diffusion-config {...} --hf-overrides {...}`): the last
    occurrence of each flag wins whole, as in vLLM's parser (``-dc`` and ``--flag=value`` too); a
    setting it leaves out is vLLM's own default, not shown. None
    when the command line names none (not a DiffusionGemma replica, or no process)."""
    last: dict = {}  # flag group -> its last value: a later flag replaces the whole JSON, as argparse does
    for flag, data in json_flags(argv, ("--diffusion-config", "-dc", "--hf-overrides")):
        group = "overrides" if flag == "--hf-overrides" else "config"
        keys = DIFFUSION_OVERRIDES if group == "overrides" else DIFFUSION_CONFIG
        last[group] = {k: data[k] for k in keys if k in data}
    found = {**last.get("config", {}), **last.get("overrides", {})}
    return found or None


def check_flags(args: list[str]):
    known = known_options()
    for arg in args:
        if arg.startswith("-") and not re.match(r"^-?\d", arg):
            flag = arg.split("=", 1)[0]
            if flag not in known:
                raise StepFailed(f"vllm serve has no option {flag} (vLLM 0.33.0): fix extra_serve_args")

