"""start: the service running (state: started) and answering /health and
/v1/models, or stopped (state: stopped). Reports the time to ready."""
from __future__ import annotations

import shlex

from converge.changes import Command, Role
from converge.errors import StepFailed

from roles.fleet import is_serving
from roles.replicas import service
from roles.service.ready import AWAIT_READY, entries, failed_unit, late_units, prelude, ready_seconds
from roles.service.rollout import gated, is_running
from roles.serving_host import env_path, record_path, restart, step_name, unit_state


def wait_script(v: dict, units: list[tuple[str, int]], timeout: int) -> str:
    """Start every ``(unit, loopback port)`` at once, then wait until each is ready (the one
    readiness loop, roles/service/ready.py: replicas on separate GPUs start side by side)."""
    names = " ".join(shlex.quote(unit) for unit, _ in units)
    return f"""
{prelude(env_path(v))}
journal() {{ [ $# -gt 1 ] && echo "  | -- $1"; journalctl -u "$1" -n 25 --no-pager -o cat 2>/dev/null | sed 's/^/  | /'; }}
{AWAIT_READY.strip()}
for u in {names}; do systemctl reset-failed "$u" 2>/dev/null; done
systemctl start {names} || {{ echo "@failed start"; for u in {names}; do journal "$u" {len(units)}; done; exit 3; }}
if await_ready {int(timeout)} {entries(units)}; then exit 0; fi
if [ -n "$failed_unit" ]; then journal "$failed_unit" {len(units)}; exit 3; fi
for u in {names}; do journal "$u" {len(units)}; done; exit 4
"""


def parse_wait(result) -> tuple[float | None, bool, str]:
    """What wait_script printed: seconds to ready (or None), whether it timed out, the journal tail."""
    journal = "\n".join(line for line in result.stdout.splitlines() if line.startswith("  | "))
    timed_out = bool(late_units(result.stdout))
    return (ready_seconds(result.stdout) if result.rc == 0 else None), timed_out, journal


def plan(ctx):
    v = ctx.vars
    replicas = ctx.desired["replicas"]
    states = {r["index"]: unit_state(ctx, r["index"]) for r in replicas}
    if v.get("state", "started") == "stopped":
        for replica in replicas:
            yield Command(step_name("stopped", replica["index"]), script=f"systemctl stop {shlex.quote(replica['unit'])}\n",
                          when=is_running(states[replica["index"]]), describe=f"systemctl stop {replica['unit']}")
        return
    timeout = int(v.get("ready_timeout", 600))
    # a replica that is not running, or that a handler restarted, is waited for; one a roll
    # restarted has passed its gate there already
    wanted = [r for r in replicas if not is_running(states[r["index"]])
              or (restart(r["unit"]) in ctx.handlers_run and gated(r["unit"]) not in ctx.results)]
    units = [r["unit"] for r in wanted]
    named = ", ".join(units)

    def interpret(result):
        seconds, timed_out, journal = parse_wait(result)
        if seconds is not None:
            return f"{named} ready: /health and /v1/models answer after {seconds:.1f} s"
        if timed_out:
            raise StepFailed(f"{', '.join(late_units(result.stdout)) or named} did not answer /health and "
                             f"/v1/models within {timeout} s (ready_timeout). Last log lines:\n{journal}\n"
                             f"See: invoke logs --hosts {ctx.name}")
        which = failed_unit(result.stdout)
        raise StepFailed(f"{which[0] if which else named} failed to start "
                         f"({which[1] if which else 'systemctl start failed, exit ' + str(result.rc)}). "
                         f"Last log lines:\n{journal}")

    whys = []
    for r in wanted:
        state = states[r["index"]]
        whys.append(f"{r['unit']} restarted after a change" if is_running(state) else
                    f"{r['unit']} was {state.get('ActiveState', 'absent')}")
    yield Command("started and ready", script=wait_script(v, [(r["unit"], r["port"]) for r in wanted], timeout),
                  when=bool(wanted), describe=f"systemctl start {named}; wait for /health and /v1/models "
                                              f"({'; '.join(whys)})",
                  timeout=timeout + 60, interpret=interpret,
                  changes=any(not is_running(states[r["index"]]) for r in wanted))


def summary(ctx) -> dict:
    """What verify checks each host against (no secret in here: it may go to --json)."""

    d, v = ctx.desired, ctx.vars
    if "replicas" not in d:
        return {}
    replicas = [{"index": r["index"], "unit": r["unit"], "unit_path": r["unit_path"], "unit_text": r["unit_text"],
                 "container": r["container"], "vllm_port": r["port"], "model": r["model"], "gpus": r["gpus"],
                 "family": r["family"], "served_name": r["served_name"], "served_names": r["served_names"]}
                for r in d["replicas"]]
    return {"expected": {
        # what declares each replica: its unit file, or on NixOS our module (the units NixOS generates)
        "replicas": replicas, "declared_by": d["declared_by"], "env_path": env_path(v),
        "autostart": bool(v.get("autostart", False)), "conflicts": list(v.get("conflicts") or []),
        "state": v.get("state", "started"), "api_host": v.get("api_host", "0.0.0.0"),
        "api_port": v.get("api_port", 8000),
        "served_model_name": v.get("served_model_name", "diffusiongemma"),
        "models": sorted({r["model"] for r in replicas}), "image": d["image"],
        "image_record": record_path(v), "arch": ctx.facts.get("arch"),
        "runtime": v.get("container_runtime", "podman"), "service_name": service(v),
        "model_cache": v.get("model_cache", "/srv/models/hf-cache"),
        "model_revision": v.get("model_revision", "main")}}


ROLE = Role("start", lambda v: {}, plan, flush_handlers=True, summary=summary, hosts=is_serving)
