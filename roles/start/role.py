"""start: the service running (state: started) and answering /health and
/v1/models, or stopped (state: stopped). Reports the time to ready."""
from __future__ import annotations

import re
import shlex

from converge.changes import Command, Role
from converge.errors import StepFailed

from roles.fleet import is_serving
from roles.service.role import env_path, unit_name


def wait_script(v: dict, unit: str, timeout: int) -> str:
    base = f"http://127.0.0.1:{v.get('replica_base_port', 8100)}"  # vLLM on loopback
    u = shlex.quote(unit)
    env = shlex.quote(env_path(v))
    return f"""
journal() {{ journalctl -u {u} -n 25 --no-pager -o cat 2>/dev/null | sed 's/^/  | /'; }}
systemctl reset-failed {u} 2>/dev/null
systemctl start {u} || {{ echo "@failed start"; journal; exit 3; }}
# the key is read into a variable and given to curl on stdin: never on a command line
key=$(sed -n 's/^VLLM_API_KEY=//p' {env} 2>/dev/null)
start=$(date +%s)
while :; do
  now=$(date +%s); elapsed=$((now - start))
  state=$(systemctl is-active {u})
  if [ "$state" = failed ] || [ "$state" = inactive ]; then
    echo "@failed $state after $elapsed s"; journal; exit 3
  fi
  if curl -fsS -o /dev/null --max-time 5 {base}/health 2>/dev/null; then
    if printf 'header = "Authorization: Bearer %s"\\n' "$key" | curl -fsS --max-time 5 -K - -o /dev/null {base}/v1/models 2>/dev/null; then
      echo "@ready $elapsed"; exit 0
    fi
  fi
  if [ $elapsed -ge {int(timeout)} ]; then echo "@timeout $elapsed $state"; journal; exit 4; fi
  sleep 0.5
done
"""


def is_running(unit_state: dict | None) -> bool:
    unit_state = unit_state or {}
    return unit_state.get("ActiveState") == "active" and unit_state.get("SubState") == "running"


def parse_wait(result) -> tuple[str | None, bool, str]:
    """What wait_script printed: seconds to ready (or None), whether it timed out, the journal tail."""
    ready = re.search(r"^@ready (\d+)", result.stdout, re.M)
    journal = "\n".join(line for line in result.stdout.splitlines() if line.startswith("  | "))
    timed_out = bool(re.search(r"^@timeout", result.stdout, re.M))
    return (ready.group(1) if result.rc == 0 and ready else None), timed_out, journal


def plan(ctx):
    v = ctx.vars
    unit = unit_name(v)
    facts_unit = ctx.facts.get("unit") or {}
    active = is_running(facts_unit)
    if v.get("state", "started") == "stopped":
        yield Command("stopped", script=f"systemctl stop {shlex.quote(unit)}\n", when=active,
                      describe=f"systemctl stop {unit}")
        return
    restarted = "restart" in ctx.handlers_run
    timeout = int(v.get("ready_timeout", 600))

    def interpret(result):
        seconds, timed_out, journal = parse_wait(result)
        if seconds is not None:
            return f"{unit} ready: /health and /v1/models answer after {seconds} s"
        if timed_out:
            raise StepFailed(f"{unit} did not answer /health and /v1/models within {timeout} s "
                             f"(ready_timeout). Last log lines:\n{journal}\nSee: invoke logs --hosts {ctx.name}")
        out = result.stdout
        raise StepFailed(f"{unit} failed to start ({out.splitlines()[0] if out else result.rc}). "
                         f"Last log lines:\n{journal}")

    why = "restarted after a change" if restarted and active else f"was {facts_unit.get('ActiveState', 'absent')}"
    yield Command("started and ready", script=wait_script(v, unit, timeout), when=not active or restarted,
                  describe=f"systemctl start {unit}; wait for /health and /v1/models ({why})",
                  timeout=timeout + 60, interpret=interpret, changes=not active)


def summary(ctx) -> dict:
    """What verify checks each host against (no secret in here: it may go to --json)."""
    from roles.image.role import record_path
    d, v = ctx.desired, ctx.vars
    if "unit_text" not in d:
        return {}
    return {"expected": {
        # what declares the service: our unit file, or on NixOS our module (its unit NixOS generates)
        "unit": unit_name(v), "unit_path": d["unit_path"], "unit_text": d["unit_text"],
        "declared_by": d["declared_by"], "env_path": env_path(v),
        "autostart": bool(v.get("autostart", False)), "conflicts": list(v.get("conflicts") or []),
        "state": v.get("state", "started"), "api_host": v.get("api_host", "0.0.0.0"),
        "api_port": v.get("api_port", 8000), "vllm_port": v.get("replica_base_port", 8100),
        "served_model_name": v.get("served_model_name", "diffusiongemma"), "model": d["model"], "image": d["image"],
        "image_record": record_path(v), "arch": ctx.facts.get("arch"),
        "runtime": v.get("container_runtime", "podman"),
        "model_cache": v.get("model_cache", "/srv/models/hf-cache"),
        "model_revision": v.get("model_revision", "main")}}


ROLE = Role("start", lambda v: {}, plan, flush_handlers=True, summary=summary, hosts=is_serving)
