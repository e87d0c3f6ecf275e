"""service: the systemd unit that runs vLLM in a container (one per replica), its
0600 environment file for secrets, and boot enablement. A running replica whose
unit, environment, image or weights changed is rolled (rollout.py: drained, changed,
restarted, gated, rolled back on failure); one that does not run gets its files,
and handlers reload systemd and restart only what changed."""
from __future__ import annotations

import shlex
from pathlib import Path

import jinja2

from converge.changes import Check, Command, Decision, File, Role
from converge.facts.host import FileState, OsRelease, TextFiles
from converge.secrets import read_optional_secret as read_secret

from serving.container_unit import RUNTIME_PATHS, command_line
from serving.declared import served_name, served_names
from serving.exporter_containers import nixos_declarations
from serving.fleet import is_serving
from serving.handoffs import CHOICE, UNITS, UnitPlan, Units
from serving.haproxy.instance import nixos_container
from serving.nixos_module import CONFIGURATION, NIXOS_DIR, imported, imports_line, module_path, nix_value
from serving.replicas import Replica, Served, name_globs, units_of
from serving.scrape_targets import uses_dcgm
from serving.templates import environment
from serving.systemd import folders_script, systemctl
from serving.serving_host import (STAMP_DIR, UNITS_FACT, env_path, env_stamp_path, image_stamp_path, is_running,
                                record_path, restart, step_name, unit_file, unit_state, units_fact)

from .container import container_spec, run_command
from .rollout import at_once, command as roll_command, fleet_throttle, fronted_by_gateway, plan_roll

HERE = Path(__file__).parent


def facts(hostvars):
    return {"env_file": FileState(env_path(hostvars), secret=True),
            # every replica's unit file and state
            **units_fact(hostvars),
            # which environment each running replica was started with (a sha256, never the file)
            "env_started": TextFiles(*name_globs(hostvars, f"{STAMP_DIR}/", ".env-started")),
            # which image record each replica started under (the image role reads the record)
            "images_started": TextFiles(*name_globs(hostvars, f"{STAMP_DIR}/", ".image-started")),
            "os": OsRelease(),
            # NixOS declares units: our module and whether the configuration imports it
            "nixos_module": FileState(module_path(hostvars)),
            "nixos_configuration": TextFiles(f"{NIXOS_DIR}/*.nix")}


def is_nixos(ctx) -> bool:
    return (ctx.facts.get("os") or {}).get("ID") == "nixos"


def _templates() -> jinja2.Environment:
    env = environment(HERE / "templates")  # this folder's alone: the filters are set on it once more, alike
    env.filters["nix"] = nix_value
    env.filters["sh"] = lambda value: shlex.quote(str(value))
    return env


def start_notes(v: dict, replica: Replica) -> str:
    """The shell that writes both notes as the replica starts (templates/start_notes.sh.j2; systemd
    reads EnvironmentFile just before), so a deploy sees a replica still running an older
    environment or image."""
    return _templates().get_template("start_notes.sh.j2").render(
        stamp_dir=STAMP_DIR, env_file=env_path(v), env_stamp=env_stamp_path(replica), record=record_path(v),
        image_stamp=image_stamp_path(replica)).strip()


def render_unit(v: dict, image: str, served: Served, has_token: bool) -> str:
    """One replica's unit."""
    spec = container_spec(v, image, served, has_token)
    return _templates().get_template("unit.j2").render(
        model=served.model, name=spec.name, runtime=spec.runtime, runtime_path=RUNTIME_PATHS[spec.runtime],
        conflicts=v.get("conflicts") or [], burst=v.get("start_limit_burst", 3),
        interval=v.get("start_limit_interval_sec", 900), env_file=env_path(v),
        start_notes=shlex.quote(start_notes(v, served.replica)),
        exec_start=command_line(run_command(spec)), restart_sec=v.get("restart_sec", 15),
        start_timeout=v.get("start_timeout_sec", 900))


def render_module(v: dict, image: str, replicas: list[Served], has_token: bool, dcgm: bool = False) -> str:
    """Every replica as a NixOS module (oci-containers), for hosts whose units are declared,
    with the front door's container and the host's exporters beside them."""
    containers = [{"spec": container_spec(v, image, served, has_token), "model": served.model,
                   "unit": served.replica.unit, "start_notes": start_notes(v, served.replica)}
                  for served in replicas]
    return _templates().get_template("module.nix.j2").render(
        containers=containers, frontdoor=nixos_container(v), env_file=env_path(v), conflicts=v.get("conflicts") or [],
        exporters=nixos_declarations(v, dcgm, [s.replica for s in replicas]),
        autostart=bool(v.get("autostart", False)), burst=v.get("start_limit_burst", 3),
        interval=v.get("start_limit_interval_sec", 900), restart_sec=v.get("restart_sec", 15),
        start_timeout=v.get("start_timeout_sec", 900), path=module_path(v))


def render_env(api_key: str | None, hf_token: str | None) -> str:
    lines = ["# Managed by dgemma-fleet: secrets for the vLLM unit (mode 0600)\n"]
    lines.append(f"VLLM_API_KEY={api_key or ''}\n")
    if hf_token:
        lines.append(f"HF_TOKEN={hf_token}\n")
    return "".join(lines)


def _env_stamp(ctx, replica: Replica) -> list[str]:
    return ((ctx.facts.get("env_started") or {}).get(env_stamp_path(replica)) or "").split()


def plan(ctx):
    v = ctx.vars
    api_key = read_secret(v.get("api_key_file"), "api_key_file", ctx.name)
    hf_token = read_secret(v.get("hf_token_file"), "hf_token_file", ctx.name)
    # each replica the placement gave, handed its GPUs by uuid: vLLM sees those alone
    served = [Served.of(v, placed) for placed in ctx.results[CHOICE].replicas]
    image = ctx.results[CHOICE].image
    nixos = is_nixos(ctx)
    module = render_module(v, image, served, bool(hf_token), uses_dcgm(v, ctx.facts.get("dcgm"))) if nixos else None
    plans = tuple(UnitPlan(s, served_name(s.family, v), tuple(served_names(s.family, v)),
                           module_path(v) if nixos else s.replica.unit_path,
                           module or render_unit(v, image, s, bool(hf_token))) for s in served)
    # what declares the service: our unit files, or on NixOS our module
    yield Decision("replicas", produces=UNITS, value=Units(plans, "nixos" if nixos else "unit", image))
    replicas = [p.replica for p in plans]
    current = ctx.facts.get("nixos_module") if nixos else (unit_file(ctx, replicas[0]) if replicas else None)
    dirs = [v.get("model_cache", "/srv/models/hf-cache"), v.get("compile_cache", "/var/cache/vllm"), "/etc/dgemma"]
    yield Command("directories", script=folders_script(*dirs),
                  when=current is None, describe="mkdir -p " + " ".join(dirs))
    env = File("environment file", path=env_path(v), content=render_env(api_key, hf_token), mode="0600",
               secret=True, current=ctx.facts.get("env_file"), notify=tuple(restart(r.unit) for r in replicas))
    yield env
    for replica in replicas:
        yield from _environment_in_force(ctx, env, replica)
        yield _image_in_force(ctx, replica)
    # a new environment is not rolled: it carries vLLM's own key, which the front door sends from
    # its environment; they restart together (the handlers, then the frontdoor role), as a
    # replica rolled alone would refuse the key the front door still sends
    new_environment = env.content_changed() or any(_environment_stale(ctx, env, r) for r in replicas)
    if nixos:
        yield from _nixos(ctx, current, module)
        return
    installed = units_of(v, ctx.facts.get(UNITS_FACT))
    renamed = _renamed(installed, replicas)
    # replicas no longer planned go first: a GPU they hold may be another replica's now
    yield from _unplanned(ctx, installed, replicas, renamed)
    want = bool(v.get("autostart", False))
    for plan in plans:
        replica = plan.replica
        index, unit = replica.index, replica.unit
        written = File(step_name("unit file", index), path=plan.unit_path, content=plan.unit_text,
                       mode="0644", current=unit_file(ctx, replica), notify=("daemon-reload", restart(unit)))
        # a replica that runs under another name (its family's name before families had their own):
        # the roll moves it to this one
        before = renamed.get(index)
        state = unit_state(ctx, replica) if before is None else before[1]
        # notified so far: a new environment, image or weights for it, or one not in force
        # (a replica about to be stopped, state: stopped, is not worth a roll)
        if (v.get("rolling", True) and v.get("state", "started") == "started" and is_running(state)
                and not new_environment
                and (written.content_changed() or ctx.pending(restart(unit)) or before is not None)):
            yield _rolled(ctx, replica, written if written.needed() else None, image, len(plans),
                          before[0] if before else None)
        else:
            yield written
        enabled = unit_state(ctx, replica).get("UnitFileState") == "enabled"
        absent = unit_state(ctx, replica).get("LoadState") in (None, "not-found")
        yield Command(step_name("enabled at boot" if want else "not enabled at boot", index),
                      script=systemctl(unit, "enable" if want else "disable", daemon_reload=True),
                      when=enabled != want and not (not want and absent),
                      describe=f"systemctl {'enable' if want else 'disable'} {unit}")


def _renamed(installed: list, replicas: list[Replica]) -> dict[int, tuple[Replica, dict]]:
    """Index -> (the replica as installed, its unit's state) for each planned replica that runs
    under another unit than its own (a move to its family's name): the roll moves it."""
    wanted = {r.index: r for r in replicas}
    return {ident.index: (ident, state) for ident, state in installed
            if ident.index in wanted and ident.unit != wanted[ident.index].unit and is_running(state)}


def _rolled(ctx, replica: Replica, written: File | None, image: str, count: int,
            before: Replica | None = None) -> Command:
    """A running replica whose change needs a restart, rolled (roles/service/rollout.py);
    ``before``: the replica as it runs now under another unit, which the roll replaces."""
    has_gateway = fronted_by_gateway(ctx)
    index, unit = replica.index, replica.unit
    current = unit_file(ctx, before or replica) or {}
    roll = plan_roll(ctx, "restart", [replica], unit_file=written, unit_path=replica.unit_path, image=image,
                     same_image_ref=image in current.get("content", ""), replaces=before,
                     remove_paths=_files_of(before) if before else ())
    limit = fleet_throttle(ctx)
    why = (f"it runs as {before.unit}" if before is not None else
           "a new unit" if written is not None and written.content_changed() else
           "a new environment, image or weights")
    return roll_command(roll, step_name("rolling restart", index), throttle=limit,
                        describe=f"roll {unit} ({why}): out of service in the front door"
                                 f"{' (and the gateway)' if has_gateway and count == 1 else ''}, "
                                 f"{'stop ' + before.unit + ', ' if before else ''}"
                                 f"{'write the unit, ' if written is not None else ''}restart, gate (ready, a "
                                 f"completion through the front door, its checks), back in service"
                                 f"{', remove ' + before.unit if before else ''}; on failure back "
                                 f"to what it ran; {at_once(limit)}",
                        diff=written.diff() if written is not None else "", satisfies=(restart(unit),))


def _files_of(replica: Replica) -> tuple:
    """What goes with a replica's unit when it is removed: the unit, its previous version, its notes."""
    return (replica.unit_path, replica.unit_path + ".previous", env_stamp_path(replica), image_stamp_path(replica))


def _unplanned(ctx, installed: list, replicas: list[Replica], renamed: dict):
    """Replica units the placement no longer gives (a GPU now busy, ``gpus`` reduced), or
    that no longer run under their family's name and do not run (the roll moves those that
    do): out of service first, then stopped, disabled and removed with their notes (a roll)."""
    limit = fleet_throttle(ctx)
    wanted = {r.index: r for r in replicas}
    for ident, state in installed:
        planned = wanted.get(ident.index)
        if planned is not None and (planned.unit == ident.unit or renamed.get(ident.index, (None,))[0] == ident):
            continue
        why = (f"replica {ident.index} is no longer planned" if planned is None else
               f"replica {ident.index} is {planned.unit} now")
        roll = plan_roll(ctx, "remove", [ident], remove_paths=_files_of(ident))
        yield roll_command(roll, f"replica {ident.index} removed" if planned is None else
                           f"{ident.unit} removed", throttle=limit,
                           describe=f"drain {ident.unit} in the front door; systemctl disable --now {ident.unit}; "
                                    f"rm {ident.unit_path} ({why}); {at_once(limit)}")


def _environment_in_force(ctx, env: File, replica: Replica):
    """A running replica started with an environment other than its file's (a run
    killed between writing the file and restarting, a file put back by hand) is
    restarted: the files alone would say nothing is to do."""
    yield Command(step_name("environment in force", replica.index), script="true\n",
                  when=_environment_stale(ctx, env, replica), notify=(restart(replica.unit),),
                  describe=f"restart: {replica.unit} runs with another environment than "
                           f"{env_path(ctx.vars)} (it changed since the service started)")


def _image_in_force(ctx, replica: Replica) -> Command:
    """A running replica started under another image record than the host's (a run stopped
    after the pull, before its turn to roll) is restarted (rolled): the image alone would
    say nothing is to do."""
    stamp = (ctx.facts.get("images_started") or {}).get(image_stamp_path(replica))
    record = (ctx.facts.get("image_record") or {}).get("content")
    stale = unit_state(ctx, replica).get("ActiveState") == "active" and bool(stamp) and bool(record) and stamp != record
    return Command(step_name("image in force", replica.index), script="true\n", when=stale,
                   notify=(restart(replica.unit),),
                   describe=f"restart: {replica.unit} runs the image the tag named before the last pull")


def _environment_stale(ctx, env: File, replica: Replica) -> bool:
    stamp = _env_stamp(ctx, replica)
    on_disk = (ctx.facts.get("env_file") or {}).get("sha256")
    return (unit_state(ctx, replica).get("ActiveState") == "active" and not env.needed() and bool(stamp)
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
        first = ctx.results[UNITS].replicas[0].replica
        loaded = unit_state(ctx, first).get("LoadState") == "loaded"
        yield Check("applied by nixos-rebuild", ok=(loaded and not module.needed()) or ctx.check,
                    message=f"{module_path(v)} changed: run nixos-rebuild switch on {ctx.name} to apply it (or set "
                            f"nixos_rebuild: true), then deploy again")


def handlers(ctx):
    declared = ctx.results.get(UNITS)
    replicas = [plan.replica for plan in declared.replicas] if declared else []
    # only a running replica restarts here; a stopped one is started (or not) by the start role
    restarts = {restart(r.unit): Command("restart" if r.index == 0 else f"restart {r.unit}",
                                         script=systemctl(r.unit, "try-restart"),
                                         describe=f"systemctl try-restart {r.unit}")
                for r in replicas}
    return {
        "daemon-reload": Command("daemon-reload", script=systemctl("", daemon_reload=True),
                                 describe="systemctl daemon-reload"),
        # NixOS applies its own configuration: it restarts the units whose definition changed
        "nixos-rebuild": Command("nixos-rebuild switch", script="nixos-rebuild switch\n",
                                 describe="nixos-rebuild switch", timeout=3600, progress=True),
        **restarts,
    }


ROLE = Role("service", facts, plan, handlers, hosts=is_serving)
