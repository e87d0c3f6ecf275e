"""Day-2 operations as roles the engine runs: start, stop (and resume what it
displaced), restart, recover a crash loop or a wedged container. Each acts on
every replica the host has, or on the one ``--replica N`` names."""
from __future__ import annotations

import shlex

from converge.changes import Command, Role
from converge.errors import StepFailed
from converge.facts.host import UnitFiles, UnitState
from converge.facts.nvidia import NvidiaSmi

from roles.fleet import is_serving
from roles.service.replicas import chosen, installed, more_units_glob, replica_name, replica_port, replica_unit
from roles.service.role import unit_name
from roles.start.role import is_running, parse_wait, wait_script


def _unit_facts(v):
    return {"unit": UnitState(unit_name(v)), "replica_units": UnitFiles(more_units_glob(v))}


def targets(ctx, replica: int | None) -> dict[int, dict]:
    """Replica index -> unit state, for the replicas this command acts on."""
    found = installed(ctx.vars, ctx.facts.get("unit"), ctx.facts.get("replica_units"))
    if not found:
        raise StepFailed(f"{unit_name(ctx.vars)} is not installed: run invoke deploy --hosts {ctx.name}")
    picked = chosen(found, replica)
    if not picked:
        raise StepFailed(f"{ctx.name} has no replica {replica} (it has {', '.join(map(str, found))}): "
                         f"see invoke status --hosts {ctx.name}")
    return {index: found[index] for index in picked}


def _ready(ctx, indices: list[int], timeout: int, when: bool = True) -> Command:
    v = ctx.vars
    units = [replica_unit(v, i) for i in indices]
    named = ", ".join(units)

    def interpret(result):
        seconds, _, journal = parse_wait(result)
        if seconds is not None:
            return f"{named} ready after {seconds} s"
        raise StepFailed(f"{named} did not become ready. Last log lines:\n{journal}\n"
                         f"Try: invoke recover --hosts {ctx.name}")
    return Command("start and wait for ready", script=wait_script(v, [(replica_unit(v, i), replica_port(v, i))
                                                                     for i in indices], timeout),
                   describe=f"systemctl start {named} (stops {', '.join(v.get('conflicts') or []) or 'nothing'});"
                            f" wait for /health and /v1/models", timeout=timeout + 60, interpret=interpret,
                   when=when and bool(indices))


def start_role(timeout: int | None = None, replica: int | None = None) -> Role:
    def plan(ctx):
        stopped = [i for i, state in targets(ctx, replica).items() if not is_running(state)]
        yield _ready(ctx, stopped, timeout or int(ctx.vars.get("ready_timeout", 600)))
    return Role("start", _unit_facts, plan, hosts=is_serving)


def stop_role(resume: bool = False, replica: int | None = None) -> Role:
    def plan(ctx):
        picked = targets(ctx, replica)
        for index, state in picked.items():
            name = replica_unit(ctx.vars, index)
            yield Command("stop" if len(picked) == 1 else f"stop replica {index}",
                          script=f"systemctl stop {shlex.quote(name)}\n", describe=f"systemctl stop {name}",
                          when=state.get("ActiveState") in ("active", "activating", "deactivating", "reloading"))
        if resume:
            if replica is not None:
                raise StepFailed("--resume starts what vLLM displaced, once every replica is stopped: "
                                 "leave out --replica")
            for other in ctx.vars.get("conflicts") or []:
                yield Command(f"resume {other}", script=f"systemctl start {shlex.quote(other)}\n",
                              describe=f"systemctl start {other} (displaced by vLLM)")
    return Role("stop", _unit_facts, plan, hosts=is_serving)


def restart_role(timeout: int | None = None, replica: int | None = None) -> Role:
    def plan(ctx):
        picked = list(targets(ctx, replica))
        names = [replica_unit(ctx.vars, i) for i in picked]
        yield Command("stop", script=f"systemctl stop {' '.join(shlex.quote(n) for n in names)}\n",
                      describe=f"systemctl stop {' '.join(names)}")
        yield _ready(ctx, picked, timeout or int(ctx.vars.get("ready_timeout", 600)))
    return Role("restart", _unit_facts, plan, hosts=is_serving)


def recover_role(replica: int | None = None) -> Role:
    """Seed 000's recovery: tell a wedged GPU (needs a reboot) from a wedged container (doesn't)."""
    def facts(v):
        return {**_unit_facts(v), "nvidia": NvidiaSmi(v.get("nvidia_smi_timeout", 15))}

    def plan(ctx):
        v = ctx.vars
        try:
            ctx.facts["nvidia"]
        except Exception as exc:  # FactError: hung, missing or failing nvidia-smi
            raise StepFailed(f"nvidia-smi does not answer ({exc}). The GPU or its driver is wedged: reboot "
                             f"{ctx.name}. Nothing was touched.") from exc
        yield Command("GPU answers", script="true\n", describe="nvidia-smi answered: only the container side "
                      "can be stuck", changes=False)
        picked = list(targets(ctx, replica))
        for index in picked:
            yield from _clear(v, index, "" if len(picked) == 1 else f" (replica {index})")
        if v.get("state", "started") == "started":
            yield _ready(ctx, picked, int(v.get("ready_timeout", 600)))
    return Role("recover", facts, plan, hosts=is_serving)


def _clear(v: dict, index: int, suffix: str):
    """One replica's unit stopped and reset, its container's processes killed and the container gone."""
    name = replica_unit(v, index)
    cname = replica_name(v, index)
    rt = v.get("container_runtime", "podman")
    q, qc, qrt = shlex.quote(name), shlex.quote(cname), shlex.quote(rt)
    yield Command(f"stop the unit{suffix}", script=f"timeout 120 systemctl stop {q}; systemctl kill -s KILL {q} "
                  f"2>/dev/null; true\n", describe=f"systemctl stop {name} (ends a restart loop)")
    yield Command(f"reset-failed{suffix}", script=f"systemctl reset-failed {q} 2>/dev/null; true\n",
                  describe=f"systemctl reset-failed {name}")
    # podman: the container's process and its conmon; docker: its process (containerd's
    # shim reaps it), then docker's own SIGKILL
    pids = "{{.State.Pid}} {{.State.ConmonPid}}" if rt == "podman" else "{{.State.Pid}}"
    also = "" if rt == "podman" else f"{qrt} kill --signal KILL {qc} >/dev/null 2>&1 && echo 'docker kill'; "
    yield Command(f"kill stuck processes{suffix}",
                  script=(f"pids=$({qrt} inspect --format {shlex.quote(pids)} {qc} "
                          f"2>/dev/null | tr ' ' '\\n' | grep -v '^0$' | grep -v '^$'); "
                          f"for p in $pids; do kill -9 $p 2>/dev/null && echo \"killed $p\"; done; {also}true\n"),
                  describe=f"kill -9 the PIDs of container {cname}",
                  interpret=lambda r: ", ".join(r.stdout.split("\n")).strip(", ") or "none were left")
    # podman waits at most 1 s for a stop (seed 000); docker's rm -f kills at once
    rm = f"{qrt} rm -f --time 1 {qc}" if rt == "podman" else f"{qrt} rm -f {qc}"
    yield Command(f"remove the container{suffix}", script=f"timeout 60 {rm} >/dev/null 2>&1; "
                  f"{qrt} inspect {qc} >/dev/null 2>&1 && {{ echo still there; exit 1; }}; true\n",
                  describe=rm.replace("'", ""))
