"""service: the systemd unit that runs vLLM in a container, its 0600
environment file for secrets, and boot enablement; handlers reload systemd and
restart the service only when the unit, the environment or the image changed."""
from __future__ import annotations

import os
import shlex
from pathlib import Path

import jinja2

from converge.changes import Command, File, Role
from converge.errors import StepFailed
from converge.facts.host import FileState, UnitState

from .serve import command_line, serve_args

HERE = Path(__file__).parent
RUNTIME_PATHS = {"podman": "/usr/bin/podman", "docker": "/usr/bin/docker"}
CONTAINER_CACHE = "/root/.cache/huggingface"


def unit_name(v: dict) -> str:
    return f"{v.get('container_runtime', 'podman')}-{v.get('service_name', 'vllm-diffusiongemma')}.service"


def unit_path(v: dict) -> str:
    return f"/etc/systemd/system/{unit_name(v)}"


def env_path(v: dict) -> str:
    return f"/etc/dgemma/{v.get('service_name', 'vllm-diffusiongemma')}.env"


def facts(hostvars):
    return {"unit_file": FileState(unit_path(hostvars)),
            "env_file": FileState(env_path(hostvars), secret=True),
            "unit": UnitState(unit_name(hostvars))}


def read_secret(path: str | None, what: str, host: str) -> str | None:
    """A secret from a file on the control machine; never echoed anywhere."""
    if not path:
        return None
    full = os.path.expanduser(path)
    try:
        value = Path(full).read_text().strip()
    except OSError as exc:
        raise StepFailed(f"{what}: cannot read {path} on this machine ({exc.strerror}); create it with the "
                         f"secret on one line (chmod 600)") from exc
    if not value or "\n" in value:
        raise StepFailed(f"{what}: {path} must hold the secret on exactly one line")
    return value


def render_unit(v: dict, image: str, model: str, utilization: float, has_token: bool) -> str:
    runtime = v.get("container_runtime", "podman")
    name = v.get("service_name", "vllm-diffusiongemma")
    rt = RUNTIME_PATHS[runtime]
    run = [rt, "run", "--rm", "--name", name]
    run += ["--device", "nvidia.com/gpu=all"] if runtime == "podman" else ["--gpus", "all"]
    run += ["--network=host", "--ipc=host",
            "-v", f"{v.get('model_cache', '/srv/models/hf-cache')}:{CONTAINER_CACHE}",
            "-v", f"{v.get('compile_cache', '/var/cache/vllm')}:/root/.cache/vllm",
            # names only: the values come from EnvironmentFile, so they never reach a command line
            "-e", "VLLM_API_KEY"]
    if has_token:
        run += ["-e", "HF_TOKEN"]
    run += ["-e", "VLLM_USE_V2_MODEL_RUNNER=1", "-e", "HF_HUB_OFFLINE=1", "-e", "HF_HUB_DISABLE_XET=1", image]
    run += serve_args(v, model, utilization)
    template = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), keep_trailing_newline=True,
                                  undefined=jinja2.StrictUndefined)
    return template.get_template("unit.j2").render(
        model=model, name=name, runtime=runtime, runtime_path=rt, conflicts=v.get("conflicts") or [],
        burst=v.get("start_limit_burst", 3), interval=v.get("start_limit_interval_sec", 900),
        env_file=env_path(v), exec_start=command_line(run), restart_sec=v.get("restart_sec", 15),
        start_timeout=v.get("start_timeout_sec", 900))


def render_env(api_key: str | None, hf_token: str | None) -> str:
    lines = ["# Managed by dgemma-fleet: secrets for the vLLM unit (mode 0600)\n"]
    lines.append(f"VLLM_API_KEY={api_key or ''}\n")
    if hf_token:
        lines.append(f"HF_TOKEN={hf_token}\n")
    return "".join(lines)


def plan(ctx):
    v = ctx.vars
    api_key = read_secret(v.get("api_key_file"), "api_key_file", ctx.name)
    hf_token = read_secret(v.get("hf_token_file"), "hf_token_file", ctx.name)
    ctx.desired.update(env_file=env_path(v), hf_token=bool(hf_token), unit=unit_name(v), api_key=api_key)
    unit_text = render_unit(v, ctx.desired["image"], ctx.desired["model"], ctx.desired["utilization"],
                            bool(hf_token))
    ctx.desired["unit_text"] = unit_text
    dirs = [v.get("model_cache", "/srv/models/hf-cache"), v.get("compile_cache", "/var/cache/vllm"), "/etc/dgemma"]
    yield Command("directories", script="mkdir -p " + " ".join(shlex.quote(d) for d in dirs) + "\n",
                  when=ctx.facts.get("unit_file") is None, describe="mkdir -p " + " ".join(dirs))
    yield File("environment file", path=env_path(v), content=render_env(api_key, hf_token), mode="0600",
               secret=True, current=ctx.facts.get("env_file"), notify=("restart",))
    yield File("unit file", path=unit_path(v), content=unit_text, mode="0644", current=ctx.facts.get("unit_file"),
               notify=("daemon-reload", "restart"))
    unit = ctx.facts.get("unit") or {}
    enabled = unit.get("UnitFileState") == "enabled"
    name = shlex.quote(unit_name(v))
    want = bool(v.get("autostart", False))
    yield Command("enabled at boot" if want else "not enabled at boot",
                  script=f"systemctl daemon-reload\nsystemctl {'enable' if want else 'disable'} {name}\n",
                  when=enabled != want and not (not want and unit.get("LoadState") == "not-found"),
                  describe=f"systemctl {'enable' if want else 'disable'} {unit_name(v)}")


def handlers(ctx):
    name = shlex.quote(unit_name(ctx.vars))
    return {
        "daemon-reload": Command("daemon-reload", script="systemctl daemon-reload\n",
                                 describe="systemctl daemon-reload"),
        # only a running service restarts here; a stopped one is started (or not) by the start role
        "restart": Command("restart", script=f"systemctl try-restart {name}\n",
                           describe=f"systemctl try-restart {unit_name(ctx.vars)}"),
    }


ROLE = Role("service", facts, plan, handlers)
