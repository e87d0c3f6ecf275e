"""Day-2 operations as roles the engine runs: start, stop (and resume what it
displaced), restart, recover a crash loop or a wedged container. Each acts on every
replica the host has, or on the one ``--replica N`` names.

Each goes through the roll (roles/service/rollout.py), as deploy's changes do: out
of service in the front door (and the gateway, when it is the host's last), the
action, the gate where a replica comes back, back in service; one replica of the
fleet at a time behind a gateway (``rollout_concurrency``), so a restart of every
host answers every request. ``now=True`` (``--now``) acts on all of a host's
replicas at once, still drained and gated, with no fleet-wide limit: for an
emergency, when waiting for one replica at a time costs more than the requests
that fail."""
from __future__ import annotations


from converge.changes import Command, Role
from converge.errors import StepFailed
from converge.facts.nvidia import NvidiaSmi

from serving.fleet import is_serving
from serving.replicas import Replica, chosen, installed
from roles.service.rollout import at_once, command as roll_command, fleet_throttle, plan_roll
from serving.serving_host import UNITS_FACT, is_running, step_name, units_fact
from serving.systemd import systemctl


def _unit_facts(v):
    # the unit files too: which GPUs each replica's unit hands over (its gate checks them)
    return units_fact(v)


def targets(ctx, replica: int | None) -> dict[int, tuple[Replica, dict]]:
    """Replica index -> (the replica, its unit's state), for the replicas this command acts on."""
    found = installed(ctx.vars, ctx.facts.get(UNITS_FACT))
    if not found:
        raise StepFailed(f"{ctx.name} has no replica installed: run invoke deploy --hosts {ctx.name}")
    picked = chosen(found, replica)
    if not picked:
        raise StepFailed(f"{ctx.name} has no replica {replica} (it has {', '.join(map(str, found))}): "
                         f"see invoke status --hosts {ctx.name}")
    return {index: found[index] for index in picked}


def _name(step: str, indices: list[int], every: int) -> str:
    if len(indices) == 1:
        return step_name(step, indices[0])
    return step if len(indices) == every else f"{step} (replicas {', '.join(map(str, indices))})"


def _rolls(ctx, action: str, replicas: list[Replica], step: str, what: str, now: bool, every: int):
    """One roll per replica, throttled run-wide as deploy's; or, ``now``, one roll of them all."""
    if not replicas:
        return
    limit = fleet_throttle(ctx)
    for group in ([replicas] if now else [[r] for r in replicas]):
        units = ", ".join(r.unit for r in group)
        yield roll_command(plan_roll(ctx, action, group), _name(step, [r.index for r in group], every),
                           throttle=None if now else limit,
                           describe=f"{units}: out of service in the front door, {what}, back in service; "
                                    f"{'all at once (--now)' if now else at_once(limit)}")


def start_role(replica: int | None = None) -> Role:
    def plan(ctx):
        picked = targets(ctx, replica)
        stopped = [ident for ident, state in picked.values() if not is_running(state)]
        if not stopped:
            yield Command("start", script="true\n", when=False,
                          describe=f"{', '.join(ident.unit for ident, _ in picked.values())} already running")
            return
        # replicas that are out add capacity as they come back: side by side, each through its gate
        yield roll_command(plan_roll(ctx, "start", stopped),
                           _name("start and gate", [r.index for r in stopped], len(picked)),
                           describe=f"systemctl start {', '.join(r.unit for r in stopped)} "
                                    f"(stops {', '.join(ctx.vars.get('conflicts') or []) or 'nothing'}); ready, a "
                                    f"completion through the front door, back in service")
    return Role("start", _unit_facts, plan, hosts=is_serving)


def stop_role(resume: bool = False, replica: int | None = None, now: bool = False) -> Role:
    def plan(ctx):
        picked = targets(ctx, replica)
        if resume and replica is not None:
            raise StepFailed("--resume starts what vLLM displaced, once every replica is stopped: "
                             "leave out --replica")
        running = [ident for ident, state in picked.values()
                   if state.get("ActiveState") in ("active", "activating", "deactivating", "reloading")]
        if not running:
            yield Command("stop", script="true\n", when=False, describe="already stopped")
        yield from _rolls(ctx, "stop", running, "drain and stop", "systemctl stop", now, len(picked))
        if resume:
            for other in ctx.vars.get("conflicts") or []:
                yield Command(f"resume {other}", script=systemctl(other, "start"),
                              describe=f"systemctl start {other} (displaced by vLLM)")
    return Role("stop", _unit_facts, plan, hosts=is_serving)


def restart_role(replica: int | None = None, now: bool = False) -> Role:
    def plan(ctx):
        picked = [ident for ident, _ in targets(ctx, replica).values()]
        yield from _rolls(ctx, "restart", picked, "rolling restart",
                          "systemctl restart, gate (ready, a completion through the front door, its checks)",
                          now, len(picked))
    return Role("restart", _unit_facts, plan, hosts=is_serving)


def recover_role(replica: int | None = None, now: bool = False) -> Role:
    """Seed 000's recovery: tell a wedged GPU (needs a reboot) from a wedged container (doesn't)."""
    def facts(v):
        return {**_unit_facts(v), "nvidia": NvidiaSmi(v.get("nvidia_smi_timeout", 15))}

    def plan(ctx):
        try:
            ctx.facts["nvidia"]
        except Exception as exc:  # FactError: hung, missing or failing nvidia-smi
            raise StepFailed(f"nvidia-smi does not answer ({exc}). The GPU or its driver is wedged: reboot "
                             f"{ctx.name}. Nothing was touched.") from exc
        yield Command("GPU answers", script="true\n", describe="nvidia-smi answered: only the container side "
                      "can be stuck", changes=False)
        picked = [ident for ident, _ in targets(ctx, replica).values()]
        again = ", then start and gate" if ctx.vars.get("state", "started") == "started" else ""
        yield from _rolls(ctx, "recover", picked, "recover",
                          f"stop and reset the unit (ends a restart loop), kill -9 its container's processes, "
                          f"rm -f the container{again}", now, len(picked))
    return Role("recover", facts, plan, hosts=is_serving)
