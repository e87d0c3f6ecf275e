"""service: the systemd unit that runs vLLM in a container (one per replica), its
0600 environment file for secrets, and boot enablement. A running replica whose
unit, environment, image or weights changed is rolled (rollout.py: drained, changed,
restarted, gated, rolled back on failure); one that does not run gets its files,
and handlers reload systemd and restart only what changed."""
from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

from converge.changes import Check, Command, File, Role
from converge.facts.host import FileState, OsRelease, TextFiles, UnitFiles, UnitState
from converge.secrets import read_optional_secret as read_secret

from roles.fleet import is_serving
from roles.scrape_targets import uses_dcgm
from roles.serving_host import (STAMP_DIR, env_path, env_stamp_path, image_stamp_path, restart,
                                start_notes_command, step_name, unit_file, unit_name, unit_path, unit_state)

from .container import RUNTIME_PATHS, container_spec, run_command
from .nixos import CONFIGURATION, NIXOS_DIR, imported, imports_line, module_path, nix_value
from roles.preflight.declared import served_name, served_names
from roles.replicas import (Served, installed, more_units_glob, replica_name, replica_port, replica_unit,
                       replica_unit_path, service)
from .rollout import at_once, command as roll_command, fleet_throttle, fronted_by_gateway, is_running, plan_roll
from .serve import command_line

HERE = Path(__file__).parent


def facts(hostvars):
    return {"unit_file": FileState(unit_path(hostvars)),
            "env_file": FileState(env_path(hostvars), secret=True),
            # which environment the running service was started with (a sha256, never the file)
            "env_started": FileState(env_stamp_path(hostvars)),
            "unit": UnitState(unit_name(hostvars)),
            # replicas 1 and up: their unit files and states, and their environment notes
            "replica_units": UnitFiles(more_units_glob(hostvars)),
            "replica_env_started": TextFiles(f"{STAMP_DIR}/{service(hostvars)}-[0-9]*.env-started"),
            # which image record each replica started under (the image role reads the record)
            "images_started": TextFiles(f"{STAMP_DIR}/{service(hostvars)}*.image-started"),
            "os": OsRelease(),
            # NixOS declares units: our module and whether the configuration imports it
            "nixos_module": FileState(module_path(hostvars)),
            "nixos_configuration": TextFiles(f"{NIXOS_DIR}/*.nix")}


def is_nixos(ctx) -> bool:
    return (ctx.facts.get("os") or {}).get("ID") == "nixos"


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), keep_trailing_newline=True,
                             undefined=jinja2.StrictUndefined)
    env.filters["nix"] = nix_value
    return env


def render_unit(v: dict, image: str, served: Served, has_token: bool) -> str:
    """One replica's unit."""
    spec = container_spec(v, image, served, has_token)
    return _templates().get_template("unit.j2").render(
        model=served.model, name=spec.name, runtime=spec.runtime, runtime_path=RUNTIME_PATHS[spec.runtime],
        conflicts=v.get("conflicts") or [], burst=v.get("start_limit_burst", 3),
        interval=v.get("start_limit_interval_sec", 900), env_file=env_path(v),
        start_notes=shlex.quote(start_notes_command(v, served.index)),
        exec_start=command_line(run_command(spec)), restart_sec=v.get("restart_sec", 15),
        start_timeout=v.get("start_timeout_sec", 900))


def render_module(v: dict, image: str, replicas: list[Served], has_token: bool, dcgm: bool = False) -> str:
    """Every replica as a NixOS module (oci-containers), for hosts whose units are declared,
    with the front door's container and the host's exporters beside them."""
    from roles.exporters.containers import nixos_declarations
    from roles.frontdoor.render import nixos_container
    containers = [{"spec": container_spec(v, image, served, has_token), "model": served.model,
                   "unit": replica_unit(v, served.index), "start_notes": start_notes_command(v, served.index)}
                  for served in replicas]
    return _templates().get_template("module.nix.j2").render(
        containers=containers, frontdoor=nixos_container(v), env_file=env_path(v), conflicts=v.get("conflicts") or [],
        exporters=nixos_declarations(v, dcgm),
        autostart=bool(v.get("autostart", False)), burst=v.get("start_limit_burst", 3),
        interval=v.get("start_limit_interval_sec", 900), restart_sec=v.get("restart_sec", 15),
        start_timeout=v.get("start_timeout_sec", 900), path=module_path(v))


def render_env(api_key: str | None, hf_token: str | None) -> str:
    lines = ["# Managed by dgemma-fleet: secrets for the vLLM unit (mode 0600)\n"]
    lines.append(f"VLLM_API_KEY={api_key or ''}\n")
    if hf_token:
        lines.append(f"HF_TOKEN={hf_token}\n")
    return "".join(lines)


def _env_stamp(ctx, index: int) -> list[str]:
    if index == 0:
        return (ctx.facts.get("env_started") or {}).get("content", "").split()
    return ((ctx.facts.get("replica_env_started") or {}).get(env_stamp_path(ctx.vars, index)) or "").split()


def plan(ctx):
    v = ctx.vars
    api_key = read_secret(v.get("api_key_file"), "api_key_file", ctx.name)
    hf_token = read_secret(v.get("hf_token_file"), "hf_token_file", ctx.name)
    # each replica the placement gave, handed its GPUs by uuid: vLLM sees those alone
    served = [Served.of(replica) for replica in ctx.desired["choice"].replicas]
    image = ctx.desired["image"]
    nixos = is_nixos(ctx)
    module = render_module(v, image, served, bool(hf_token), uses_dcgm(v, ctx.facts.get("dcgm"))) if nixos else None
    replicas = [{"index": s.index, "unit": replica_unit(v, s.index), "container": replica_name(v, s.index),
                 "port": replica_port(v, s.index), "model": s.model, "gpus": list(s.gpus), "family": s.family,
                 "served_name": served_name(s.family, v), "served_names": served_names(s.family, v),
                 "unit_path": module_path(v) if nixos else replica_unit_path(v, s.index),
                 "unit_text": module or render_unit(v, image, s, bool(hf_token))} for s in served]
    ctx.desired["replicas"] = replicas
    # what declares the service: our unit files, or on NixOS our module
    ctx.desired["declared_by"] = "nixos" if nixos else "unit"
    current = ctx.facts.get("nixos_module" if nixos else "unit_file")
    dirs = [v.get("model_cache", "/srv/models/hf-cache"), v.get("compile_cache", "/var/cache/vllm"), "/etc/dgemma"]
    yield Command("directories", script="mkdir -p " + " ".join(shlex.quote(d) for d in dirs) + "\n",
                  when=current is None, describe="mkdir -p " + " ".join(dirs))
    env = File("environment file", path=env_path(v), content=render_env(api_key, hf_token), mode="0600",
               secret=True, current=ctx.facts.get("env_file"), notify=tuple(restart(r["unit"]) for r in replicas))
    yield env
    for replica in replicas:
        yield from _environment_in_force(ctx, env, replica)
        yield _image_in_force(ctx, replica)
    # a new environment is not rolled: it carries vLLM's own key, which the front door sends from
    # its environment; they restart together (the handlers, then the frontdoor role), as a
    # replica rolled alone would refuse the key the front door still sends
    new_environment = env.content_changed() or any(_environment_stale(ctx, env, r["index"]) for r in replicas)
    if nixos:
        yield from _nixos(ctx, current, module)
        return
    # replicas no longer planned go first: a GPU they hold may be another replica's now
    yield from _unplanned(ctx, {r["index"] for r in replicas})
    want = bool(v.get("autostart", False))
    for replica in replicas:
        index, unit = replica["index"], replica["unit"]
        written = File(step_name("unit file", index), path=replica["unit_path"], content=replica["unit_text"],
                       mode="0644", current=unit_file(ctx, index), notify=("daemon-reload", restart(unit)))
        state = unit_state(ctx, index)
        # notified so far: a new environment, image or weights for it, or one not in force
        # (a replica about to be stopped, state: stopped, is not worth a roll)
        if (v.get("rolling", True) and v.get("state", "started") == "started" and is_running(state)
                and not new_environment
                and (written.content_changed() or ctx.pending(restart(unit)))):
            yield _rolled(ctx, replica, written if written.needed() else None, image, len(replicas))
        else:
            yield written
        enabled = state.get("UnitFileState") == "enabled"
        yield Command(step_name("enabled at boot" if want else "not enabled at boot", index),
                      script=f"systemctl daemon-reload\nsystemctl {'enable' if want else 'disable'} "
                             f"{shlex.quote(unit)}\n",
                      when=enabled != want and not (not want and state.get("LoadState") in (None, "not-found")),
                      describe=f"systemctl {'enable' if want else 'disable'} {unit}")


def _rolled(ctx, replica: dict, written: File | None, image: str, count: int) -> Command:
    """A running replica whose change needs a restart, rolled (roles/service/rollout.py)."""
    has_gateway = fronted_by_gateway(ctx)
    index, unit = replica["index"], replica["unit"]
    current = unit_file(ctx, index) or {}
    roll = plan_roll(ctx, "restart", [index], unit_file=written, unit_path=replica["unit_path"], image=image,
                     same_image_ref=image in current.get("content", ""))
    limit = fleet_throttle(ctx)
    why = "a new unit" if written is not None and written.content_changed() else "a new environment, image or weights"
    return roll_command(roll, step_name("rolling restart", index), throttle=limit,
                        describe=f"roll {unit} ({why}): out of service in the front door"
                                 f"{' (and the gateway)' if has_gateway and count == 1 else ''}, "
                                 f"{'write the unit, ' if written is not None else ''}restart, gate (ready, a "
                                 f"completion through the front door, its checks), back in service; on failure back "
                                 f"to what it ran; {at_once(limit)}",
                        diff=written.diff() if written is not None else "", satisfies=(restart(unit),))


def _unplanned(ctx, planned: set[int]):
    """Replica units the placement no longer gives (a GPU now busy, ``gpus`` reduced): out
    of service first, then stopped, disabled and removed with their notes (a roll)."""
    v = ctx.vars
    limit = fleet_throttle(ctx)
    for index in installed(v, ctx.facts.get("unit"), ctx.facts.get("replica_units")):
        if index in planned:
            continue
        unit, path = replica_unit(v, index), replica_unit_path(v, index)
        roll = plan_roll(ctx, "remove", [index], remove_paths=(path, path + ".previous", env_stamp_path(v, index),
                                                               image_stamp_path(v, index)))
        yield roll_command(roll, f"replica {index} removed", throttle=limit,
                           describe=f"drain {unit} in the front door; systemctl disable --now {unit}; rm {path} "
                                    f"(replica {index} is no longer planned); {at_once(limit)}")


def _environment_in_force(ctx, env: File, replica: dict):
    """A running replica started with an environment other than its file's (a run
    killed between writing the file and restarting, a file put back by hand) is
    restarted: the files alone would say nothing is to do."""
    index, unit = replica["index"], replica["unit"]
    yield Command(step_name("environment in force", index), script="true\n",
                  when=_environment_stale(ctx, env, index), notify=(restart(unit),),
                  describe=f"restart: {unit} runs with another environment than "
                           f"{env_path(ctx.vars)} (it changed since the service started)")


def _image_in_force(ctx, replica: dict) -> Command:
    """A running replica started under another image record than the host's (a run stopped
    after the pull, before its turn to roll) is restarted (rolled): the image alone would
    say nothing is to do."""
    index, unit = replica["index"], replica["unit"]
    stamp = (ctx.facts.get("images_started") or {}).get(image_stamp_path(ctx.vars, index))
    record = (ctx.facts.get("image_record") or {}).get("content")
    stale = unit_state(ctx, index).get("ActiveState") == "active" and bool(stamp) and bool(record) and stamp != record
    return Command(step_name("image in force", index), script="true\n", when=stale, notify=(restart(unit),),
                   describe=f"restart: {unit} runs the image the tag named before the last pull")


def _environment_stale(ctx, env: File, index: int) -> bool:
    stamp = _env_stamp(ctx, index)
    on_disk = (ctx.facts.get("env_file") or {}).get("sha256")
    return (unit_state(ctx, index).get("ActiveState") == "active" and not env.needed() and bool(stamp)
            and bool(on_disk) and stamp[0] != on_disk)


def _nixos(ctx, current, text: str):
    """On NixOS: the module (every replica), atomically; then the host stops unless the
    configuration imports it and it is applied (nixos-rebuild, when allowed)."""
    v = ctx.vars
    rebuild = bool(v.get("nixos_rebuild", False))
    module = File("NixOS module", path=module_path(v), content=text, mode="0644",
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
    units = [replica["unit"] for replica in ctx.desired.get("replicas") or []]
    # only a running replica restarts here; a stopped one is started (or not) by the start role
    restarts = {restart(unit): Command("restart" if unit == unit_name(ctx.vars) else f"restart {unit}",
                                       script=f"systemctl try-restart {shlex.quote(unit)}\n",
                                       describe=f"systemctl try-restart {unit}") for unit in units}
    return {
        "daemon-reload": Command("daemon-reload", script="systemctl daemon-reload\n",
                                 describe="systemctl daemon-reload"),
        # NixOS applies its own configuration: it restarts the units whose definition changed
        "nixos-rebuild": Command("nixos-rebuild switch", script="nixos-rebuild switch\n",
                                 describe="nixos-rebuild switch", timeout=3600, progress=True),
        **restarts,
    }


ROLE = Role("service", facts, plan, handlers, hosts=is_serving)
