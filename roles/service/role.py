"""service: the systemd unit that runs vLLM in a container, its 0600
environment file for secrets, and boot enablement; handlers reload systemd and
restart the service only when the unit, the environment or the image changed."""
from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

from converge.changes import Check, Command, File, Role
from converge.facts.host import FileState, OsRelease, TextFiles, UnitState
from converge.secrets import read_secret_file

from roles.fleet import is_serving

from .container import RUNTIME_PATHS, container_spec, run_command
from .nixos import CONFIGURATION, NIXOS_DIR, imported, imports_line, module_path, nix_value
from .serve import command_line

HERE = Path(__file__).parent


def unit_name(v: dict) -> str:
    return f"{v.get('container_runtime', 'podman')}-{v.get('service_name', 'vllm-diffusiongemma')}.service"


def unit_path(v: dict) -> str:
    return f"/etc/systemd/system/{unit_name(v)}"


def env_path(v: dict) -> str:
    return f"/etc/dgemma/{v.get('service_name', 'vllm-diffusiongemma')}.env"


STAMP_DIR = "/run/dgemma"


def env_stamp_path(v: dict) -> str:
    """Where the unit notes, as it starts, the sha256 of the environment file it read."""
    return f"{STAMP_DIR}/{v.get('service_name', 'vllm-diffusiongemma')}.env-started"


def env_stamp_command(v: dict) -> str:
    """The shell that writes that note (systemd reads EnvironmentFile just before)."""
    return (f"mkdir -p {STAMP_DIR} && sha256sum < {shlex.quote(env_path(v))} > "
            f"{shlex.quote(env_stamp_path(v))}")


def facts(hostvars):
    return {"unit_file": FileState(unit_path(hostvars)),
            "env_file": FileState(env_path(hostvars), secret=True),
            # which environment the running service was started with (a sha256, never the file)
            "env_started": FileState(env_stamp_path(hostvars)),
            "unit": UnitState(unit_name(hostvars)),
            "os": OsRelease(),
            # NixOS declares units: our module and whether the configuration imports it
            "nixos_module": FileState(module_path(hostvars)),
            "nixos_configuration": TextFiles(f"{NIXOS_DIR}/*.nix")}


def is_nixos(ctx) -> bool:
    return (ctx.facts.get("os") or {}).get("ID") == "nixos"


def read_secret(path: str | None, what: str, host: str) -> str | None:
    """A secret from a file on the control machine (refused unless 0600); never echoed anywhere."""
    if not path:
        return None
    return read_secret_file(path, what, host).strip()


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["nix"] = nix_value
    return env


def render_unit(v: dict, image: str, model: str, utilization: float, has_token: bool,
                gpus: list[str] | None = None, tensor_parallel_size: int = 1) -> str:
    spec = container_spec(v, image, model, utilization, has_token, gpus, tensor_parallel_size)
    return _templates().get_template("unit.j2").render(
        model=model, name=spec.name, runtime=spec.runtime, runtime_path=RUNTIME_PATHS[spec.runtime],
        conflicts=v.get("conflicts") or [], burst=v.get("start_limit_burst", 3),
        interval=v.get("start_limit_interval_sec", 900), env_file=env_path(v),
        env_stamp=shlex.quote(env_stamp_command(v)),
        exec_start=command_line(run_command(spec)), restart_sec=v.get("restart_sec", 15),
        start_timeout=v.get("start_timeout_sec", 900))


def render_module(v: dict, image: str, model: str, utilization: float, has_token: bool,
                  gpus: list[str] | None = None, tensor_parallel_size: int = 1) -> str:
    """The same service as a NixOS module (oci-containers), for hosts whose units are declared,
    with the front door's container beside it."""
    from roles.frontdoor.render import nixos_container
    spec = container_spec(v, image, model, utilization, has_token, gpus, tensor_parallel_size)
    return _templates().get_template("module.nix.j2").render(
        spec=spec, frontdoor=nixos_container(v), model=model, unit=unit_name(v), env_file=env_path(v),
        env_stamp=env_stamp_command(v), conflicts=v.get("conflicts") or [],
        autostart=bool(v.get("autostart", False)), burst=v.get("start_limit_burst", 3),
        interval=v.get("start_limit_interval_sec", 900), restart_sec=v.get("restart_sec", 15),
        start_timeout=v.get("start_timeout_sec", 900), path=module_path(v))


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
    # the GPUs the placement gave this replica, by uuid: vLLM sees those alone
    args = (v, ctx.desired["image"], ctx.desired["model"], ctx.desired["utilization"], bool(hf_token),
            ctx.desired.get("gpus"), ctx.desired.get("tensor_parallel_size", 1))
    nixos = is_nixos(ctx)
    # what declares the service: our unit file, or on NixOS our module
    ctx.desired["declared_by"] = "nixos" if nixos else "unit"
    ctx.desired["unit_path"] = module_path(v) if nixos else unit_path(v)
    ctx.desired["unit_text"] = render_module(*args) if nixos else render_unit(*args)
    current = ctx.facts.get("nixos_module" if nixos else "unit_file")
    dirs = [v.get("model_cache", "/srv/models/hf-cache"), v.get("compile_cache", "/var/cache/vllm"), "/etc/dgemma"]
    yield Command("directories", script="mkdir -p " + " ".join(shlex.quote(d) for d in dirs) + "\n",
                  when=current is None, describe="mkdir -p " + " ".join(dirs))
    env = File("environment file", path=env_path(v), content=render_env(api_key, hf_token), mode="0600",
               secret=True, current=ctx.facts.get("env_file"), notify=("restart",))
    yield env
    yield from _environment_in_force(ctx, env)
    if nixos:
        yield from _nixos(ctx, current)
        return
    yield File("unit file", path=unit_path(v), content=ctx.desired["unit_text"], mode="0644", current=current,
               notify=("daemon-reload", "restart"))
    unit = ctx.facts.get("unit") or {}
    enabled = unit.get("UnitFileState") == "enabled"
    name = shlex.quote(unit_name(v))
    want = bool(v.get("autostart", False))
    yield Command("enabled at boot" if want else "not enabled at boot",
                  script=f"systemctl daemon-reload\nsystemctl {'enable' if want else 'disable'} {name}\n",
                  when=enabled != want and not (not want and unit.get("LoadState") == "not-found"),
                  describe=f"systemctl {'enable' if want else 'disable'} {unit_name(v)}")


def _environment_in_force(ctx, env: File):
    """A running service started with an environment other than its file's (a run
    killed between writing the file and restarting, a file put back by hand) is
    restarted: the files alone would say nothing is to do."""
    unit = ctx.facts.get("unit") or {}
    stamp = (ctx.facts.get("env_started") or {}).get("content", "").split()
    on_disk = (ctx.facts.get("env_file") or {}).get("sha256")
    stale = (unit.get("ActiveState") == "active" and not env.needed() and bool(stamp) and bool(on_disk)
             and stamp[0] != on_disk)
    yield Command("environment in force", script="true\n", when=stale, notify=("restart",),
                  describe=f"restart: {unit_name(ctx.vars)} runs with another environment than "
                           f"{env_path(ctx.vars)} (it changed since the service started)")


def _nixos(ctx, current):
    """On NixOS: the module, atomically; then the host stops unless the
    configuration imports it and it is applied (nixos-rebuild, when allowed)."""
    v = ctx.vars
    rebuild = bool(v.get("nixos_rebuild", False))
    module = File("NixOS module", path=module_path(v), content=ctx.desired["unit_text"], mode="0644",
                  current=current, notify=("nixos-rebuild",) if rebuild else ())
    yield module
    configuration = ctx.facts.get("nixos_configuration") or {}
    yield Check("imported by the NixOS configuration", ok=imported(configuration, v),
                message=f"{module_path(v)} is written; add `{imports_line(v)}` to {CONFIGURATION} (or "
                        f"./{module_path(v).rsplit('/', 1)[1]} to its imports list), then deploy again"
                        f"{'' if rebuild else ' after running: nixos-rebuild switch (or set nixos_rebuild: true)'}")
    if not rebuild:
        loaded = (ctx.facts.get("unit") or {}).get("LoadState") == "loaded"
        yield Check("applied by nixos-rebuild", ok=(loaded and not module.needed()) or ctx.check,
                    message=f"{module_path(v)} changed: run nixos-rebuild switch on {ctx.name} to apply it (or set "
                            f"nixos_rebuild: true), then deploy again")


def handlers(ctx):
    name = shlex.quote(unit_name(ctx.vars))
    return {
        "daemon-reload": Command("daemon-reload", script="systemctl daemon-reload\n",
                                 describe="systemctl daemon-reload"),
        # NixOS applies its own configuration: it restarts the units whose definition changed
        "nixos-rebuild": Command("nixos-rebuild switch", script="nixos-rebuild switch\n",
                                 describe="nixos-rebuild switch", timeout=3600, progress=True),
        # only a running service restarts here; a stopped one is started (or not) by the start role
        "restart": Command("restart", script=f"systemctl try-restart {name}\n",
                           describe=f"systemctl try-restart {unit_name(ctx.vars)}"),
    }


ROLE = Role("service", facts, plan, handlers, hosts=is_serving)
