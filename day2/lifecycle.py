"""Day-2 operations as roles the engine runs: start, stop (and resume what it
displaced), restart, recover a crash loop or a wedged container."""
from __future__ import annotations

import shlex

from converge.changes import Command, Role
from converge.errors import StepFailed
from converge.facts.host import UnitState
from converge.facts.nvidia import NvidiaSmi

from roles.fleet import is_serving
from roles.service.role import unit_name
from roles.start.role import is_running, parse_wait, wait_script


def _unit_facts(v):
    return {"unit": UnitState(unit_name(v))}


def _ready(ctx, timeout):
    unit = unit_name(ctx.vars)

    def interpret(result):
        seconds, _, journal = parse_wait(result)
        if seconds is not None:
            return f"{unit} ready after {seconds} s"
        raise StepFailed(f"{unit} did not become ready. Last log lines:\n{journal}\n"
                         f"Try: invoke recover --hosts {ctx.name}")
    return Command("start and wait for ready", script=wait_script(ctx.vars, unit, timeout),
                   describe=f"systemctl start {unit} (stops {', '.join(ctx.vars.get('conflicts') or []) or 'nothing'});"
                            f" wait for /health and /v1/models", timeout=timeout + 60, interpret=interpret)


def start_role(timeout: int | None = None) -> Role:
    def plan(ctx):
        unit = ctx.facts.get("unit") or {}
        if unit.get("LoadState") == "not-found":
            raise StepFailed(f"{unit_name(ctx.vars)} is not installed: run invoke deploy --hosts {ctx.name}")
        step = _ready(ctx, timeout or int(ctx.vars.get("ready_timeout", 600)))
        step.when = not is_running(unit)
        yield step
    return Role("start", _unit_facts, plan, hosts=is_serving)


def stop_role(resume: bool = False) -> Role:
    def plan(ctx):
        unit = ctx.facts.get("unit") or {}
        name = unit_name(ctx.vars)
        yield Command("stop", script=f"systemctl stop {shlex.quote(name)}\n", describe=f"systemctl stop {name}",
                      when=unit.get("ActiveState") in ("active", "activating", "deactivating", "reloading"))
        if resume:
            for other in ctx.vars.get("conflicts") or []:
                yield Command(f"resume {other}", script=f"systemctl start {shlex.quote(other)}\n",
                              describe=f"systemctl start {other} (displaced by {name})")
    return Role("stop", _unit_facts, plan, hosts=is_serving)


def restart_role(timeout: int | None = None) -> Role:
    def plan(ctx):
        name = unit_name(ctx.vars)
        yield Command("stop", script=f"systemctl stop {shlex.quote(name)}\n", describe=f"systemctl stop {name}")
        yield _ready(ctx, timeout or int(ctx.vars.get("ready_timeout", 600)))
    return Role("restart", _unit_facts, plan, hosts=is_serving)


def recover_role() -> Role:
    """Seed 000's recovery: tell a wedged GPU (needs a reboot) from a wedged container (doesn't)."""
    def facts(v):
        return {"unit": UnitState(unit_name(v)), "nvidia": NvidiaSmi(v.get("nvidia_smi_timeout", 15))}

    def plan(ctx):
        v = ctx.vars
        try:
            ctx.facts["nvidia"]
        except Exception as exc:  # FactError: hung, missing or failing nvidia-smi
            raise StepFailed(f"nvidia-smi does not answer ({exc}). The GPU or its driver is wedged: reboot "
                             f"{ctx.name}. Nothing was touched.") from exc
        yield Command("GPU answers", script="true\n", describe="nvidia-smi answered: only the container side "
                      "can be stuck", changes=False)
        name = unit_name(v)
        cname = v.get("service_name", "vllm-diffusiongemma")
        rt = v.get("container_runtime", "podman")
        q, qc, qrt = shlex.quote(name), shlex.quote(cname), shlex.quote(rt)
        yield Command("stop the unit", script=f"timeout 120 systemctl stop {q}; systemctl kill -s KILL {q} "
                      f"2>/dev/null; true\n", describe=f"systemctl stop {name} (ends a restart loop)")
        yield Command("reset-failed", script=f"systemctl reset-failed {q} 2>/dev/null; true\n",
                      describe=f"systemctl reset-failed {name}")
        # podman: the container's process and its conmon; docker: its process (containerd's
        # shim reaps it), then docker's own SIGKILL
        pids = "{{.State.Pid}} {{.State.ConmonPid}}" if rt == "podman" else "{{.State.Pid}}"
        also = "" if rt == "podman" else f"{qrt} kill --signal KILL {qc} >/dev/null 2>&1 && echo 'docker kill'; "
        yield Command("kill stuck processes",
                      script=(f"pids=$({qrt} inspect --format {shlex.quote(pids)} {qc} "
                              f"2>/dev/null | tr ' ' '\\n' | grep -v '^0$' | grep -v '^$'); "
                              f"for p in $pids; do kill -9 $p 2>/dev/null && echo \"killed $p\"; done; {also}true\n"),
                      describe=f"kill -9 the PIDs of container {cname}",
                      interpret=lambda r: ", ".join(r.stdout.split("\n")).strip(", ") or "none were left")
        # podman waits at most 1 s for a stop (seed 000); docker's rm -f kills at once
        rm = f"{qrt} rm -f --time 1 {qc}" if rt == "podman" else f"{qrt} rm -f {qc}"
        yield Command("remove the container", script=f"timeout 60 {rm} >/dev/null 2>&1; "
                      f"{qrt} inspect {qc} >/dev/null 2>&1 && {{ echo still there; exit 1; }}; true\n",
                      describe=rm.replace("'", ""))
        if v.get("state", "started") == "started":
            yield _ready(ctx, int(v.get("ready_timeout", 600)))
    return Role("recover", facts, plan, hosts=is_serving)
