"""start: the service running (state: started) and answering /health and
/v1/models, or stopped (state: stopped). Reports the time to ready."""
from __future__ import annotations

from pathlib import Path

from converge.changes import Command, Role
from converge.errors import StepFailed

from converge.facts.host import FileState

from serving.fleet import is_serving
from serving.hf_cache import ref_path
from serving.releases import KEPT_LINES, current, history_path, parse_history
from serving.handoffs import UNITS, gated
from serving.host_programs import RESULT_LIBRARY, Program, Protocol, ended
from serving.replica_ready import PRELUDE, READY, READY_MARKERS, replica_ready
from serving.replicas import TABLE_READER, Replica, service, shell_table, unit_globs
from serving.systemd import systemctl
from serving.serving_host import STATE_DIR, env_path, is_running, record_path, restart, step_name, unit_state

START = Protocol("start and wait", markers=READY_MARKERS, exits={"failed": 3, "timeout": 4}, result={
    "state": "ready, start-failed (systemctl refused), failed (a unit failed) or timeout",
    "ms": "how long the wait took", "units": "the unit that failed, or those that did not answer in time",
    "how": "the failed unit's ActiveState/SubState, or what failed"})
PROGRAM = Program((PRELUDE, RESULT_LIBRARY, *TABLE_READER, READY, Path(__file__).parent / "files" / "start.sh"), START)
RECORD = Protocol("record the release", result={"recorded": "the units whose release was new (blank-separated)"})
RECORD_PROGRAM = Program((RESULT_LIBRARY, *TABLE_READER, Path(__file__).parent / "files" / "record_release.sh"), RECORD)


def facts(hostvars):
    return {"release_history": FileState(history_path(hostvars))}


def wait_script(v: dict, replicas: list[Replica], timeout: int) -> str:
    """Start every replica at once, then wait until each is ready (the one readiness loop,
    serving/replica_ready/__init__.py: replicas on separate GPUs start side by side)."""
    return PROGRAM.script({"ENV_FILE": env_path(v), "REPLICAS": shell_table(replicas),
                           "READY_TIMEOUT_S": int(timeout)})


def plan(ctx):
    v = ctx.vars
    replicas = [p.replica for p in ctx.results[UNITS].replicas]
    states = {r.index: unit_state(ctx, r) for r in replicas}
    if v.get("state", "started") == "stopped":
        for replica in replicas:
            yield Command(step_name("stopped", replica.index), script=systemctl(replica.unit, "stop"),
                          when=is_running(states[replica.index]), describe=f"systemctl stop {replica.unit}")
        return
    timeout = int(v.get("ready_timeout", 600))
    # a replica that is not running, or that a handler restarted, is waited for; one a roll
    # restarted (or moved to its family's name, a unit the facts did not know yet) has passed
    # its gate there already
    wanted = [r for r in replicas if gated(r.unit) not in ctx.results
              and (not is_running(states[r.index]) or restart(r.unit) in ctx.handlers_run)]
    named = ", ".join(r.unit for r in wanted)

    def interpret(result):
        said, journal = ended(START, result, named)
        if said["state"] == "ready":
            each = replica_ready(START, result.stdout)
            after = (f" ({', '.join(f'{unit} after {s:.1f} s' for unit, s in each.items())})"
                     if len(each) > 1 else "")
            return f"{named} ready: /health and /v1/models answer after {said['ms'] / 1000:.1f} s{after}"
        units = ", ".join(str(said["units"]).split()) or named
        if said["state"] == "timeout":
            raise StepFailed(f"{units} did not answer /health and /v1/models within {timeout} s (ready_timeout). "
                             f"Last log lines:\n{journal}\nSee: invoke logs --hosts {ctx.name}")
        raise StepFailed(f"{units} failed to start ({said['how'] or 'exit ' + str(result.rc)}). "
                         f"Last log lines:\n{journal}")

    whys = []
    for r in wanted:
        state = states[r.index]
        whys.append(f"{r.unit} restarted after a change" if is_running(state) else
                    f"{r.unit} was {state.get('ActiveState', 'absent')}")
    yield Command("started and ready", script=wait_script(v, wanted, timeout),
                  when=bool(wanted), describe=f"systemctl start {named}; wait for /health and /v1/models "
                                              f"({'; '.join(whys)})",
                  timeout=timeout + 60, interpret=interpret,
                  changes=any(not is_running(states[r.index]) for r in wanted))
    yield from record_releases(ctx)


def _release_rows(ctx) -> list[dict]:
    """What each replica serves, as the history records it (the digest and commit are read there)."""
    v = ctx.vars
    cache = v.get("model_cache", "/srv/models/hf-cache")
    revision = v.get("model_revision", "main")
    declared = ctx.results[UNITS]
    return [{"unit": p.replica.unit, "image": declared.image, "model": p.served.model, "revision": revision,
             "refs": ref_path(cache, p.served.model, revision)} for p in declared.replicas]


def _recorded(ctx, rows: list[dict]) -> bool:
    """Whether the history's last line for every replica already says what the facts say it serves."""
    record = ((ctx.facts.get("image_record") or {}).get("content") or "").split("\n")
    digest = record[1] if len(record) > 1 and record[0] == ctx.results[UNITS].image else ""
    weights = ctx.facts.get("weights") or {}
    last = current(parse_history((ctx.facts.get("release_history") or {}).get("content") or ""))
    for row in rows:
        commit = ((weights.get(row["model"]) or {}).get("refs") or {}).get(row["revision"], "")
        seen = last.get(row["unit"])
        if seen is None or (seen.image, seen.digest, seen.model, seen.revision, seen.commit) != \
                (row["image"], digest, row["model"], row["revision"], commit):
            return False
    return True


def record_releases(ctx):
    """Each replica's release in the host's history, once it serves it (serving/releases.py): only
    when this run changed something on the host, or the history does not say what the facts do."""
    rows = _release_rows(ctx)
    if any(any(c.isspace() or c == "=" for c in str(value)) for row in rows for value in row.values()):
        raise StepFailed(f"a replica's image or model holds a blank or '=': {rows}")
    needed = bool(ctx.changed_steps) or not _recorded(ctx, rows)

    def interpret(result):
        if result.rc != 0:
            raise StepFailed(f"the release history {history_path(ctx.vars)} could not be written (exit {result.rc}): "
                             f"{(result.stdout + result.stderr).strip()[-300:]}. Check the disk under {STATE_DIR}")
        units = str(RECORD.result_of(result.stdout)["recorded"]).split()
        return (f"recorded {', '.join(units)} in {history_path(ctx.vars)}" if units else "already recorded"), bool(units)

    yield Command("record the release", when=needed, maybe=True, timeout=60, interpret=interpret,
                  script=RECORD_PROGRAM.script({
                      "HISTORY": history_path(ctx.vars), "RECORD": record_path(ctx.vars), "STATE_DIR": STATE_DIR,
                      "KEEP_LINES": KEPT_LINES,
                      "RELEASES": "\n".join(" ".join(f"{k}={val}" for k, val in row.items()) for row in rows)}),
                  describe=f"note what each replica serves in {history_path(ctx.vars)} (image by digest, weights by "
                           f"commit), when it is new")


def summary(ctx) -> dict:
    """What verify checks each host against (no secret in here: it may go to --json)."""

    v, declared = ctx.vars, ctx.results.get(UNITS)
    if declared is None:
        return {}
    replicas = [{"index": p.replica.index, "unit": p.replica.unit, "unit_path": p.unit_path, "unit_text": p.unit_text,
                 "container": p.replica.container, "vllm_port": p.replica.port, "model": p.served.model,
                 "gpus": list(p.replica.gpus), "family": p.replica.family, "served_name": p.served_name,
                 "served_names": list(p.served_names)} for p in declared.replicas]
    return {"expected": {
        # what declares each replica: its unit file, or on NixOS our module (the units NixOS generates)
        "replicas": replicas, "declared_by": declared.declared_by, "env_path": env_path(v),
        "autostart": bool(v.get("autostart", False)), "conflicts": list(v.get("conflicts") or []),
        "state": v.get("state", "started"), "api_host": v.get("api_host", "0.0.0.0"),
        "api_port": v.get("api_port", 8000),
        "served_model_name": v.get("served_model_name", "diffusiongemma"),
        "models": sorted({r["model"] for r in replicas}), "image": declared.image,
        "image_record": record_path(v), "arch": ctx.facts.get("arch"),
        "runtime": v.get("container_runtime", "podman"), "service_name": service(v),
        "replica_unit_globs": list(unit_globs(v)),
        "model_cache": v.get("model_cache", "/srv/models/hf-cache"),
        "model_revision": v.get("model_revision", "main")}}


ROLE = Role("start", facts, plan, flush_handlers=True, summary=summary, hosts=is_serving)
