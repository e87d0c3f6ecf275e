"""The one way a running replica is changed: a roll. Out of service in its host's
front door (and so, when it was the host's last, in the gateway), the action, the
gate where it comes back, back in service. Every change that stops a replica goes
through it: deploy's changes that need a restart (a replica moving to its family's
name among them), and day 2's restart, stop, start and recover, and a replica removed
because its GPU became busy.

Actions:
- ``restart``: deploy's (a new unit written, or a new image, weights or environment in
  force) or day 2's; gated. A replica that fails the gate after deploy changed it goes
  back to exactly the unit and image it ran, is gated again and put back; the step fails
  and the run's rollout stops there. Day 2 changed nothing to go back to: the step fails.
- ``start``: stopped replicas started side by side, then gated (they were out anyway).
- ``stop``: drained, stopped; back in the front door's rotation once its checks see it
  down (it comes back up by itself when started). No gate.
- ``recover``: drained, the unit stopped and reset, its container's stuck processes
  killed and the container removed, then started and gated (when ``state: started``).
- ``remove``: drained, stopped, disabled, its files removed (placement no longer gives it).

Everything between "drained" and "back in service" is one program on the host
(files/roll.sh, with prelude.sh, ready.sh and the front door's admin.sh), so a lost link
or Ctrl-C on the control machine never leaves a replica half-changed or drained: it
ignores SIGHUP and finishes (or rolls back) on its own. What it says (its markers) and
how it ends (its exit codes) are `ROLL`, read here and nowhere else. A replica its front
door will not put back in service fails the roll, named with the command that mends it.

How the gateway learns of it: the script raises the front door's rolling flag
(serving/haproxy/admin.py); while it is up and no replica of the host is in service,
/health answers 404 and the gateway holds the host out of balancing
(``disable-on-404``: DRAIN in ``invoke status``) for the whole roll. It needs no
connection to the gateway, so ``--hosts rtx01`` drains it there too. Pure."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from converge.changes import WRITE_FILE, Command, File, Produced, Throttle
from converge.errors import StepFailed

from serving.fleet import frontdoor_port
from serving.handoffs import UNITS, gated
from serving.haproxy.admin import ADMIN_LIBRARY, FRONTDOOR_CA, admin_parameters
from serving.host_programs import RESULT_LIBRARY, Program, ProgramResultError, Protocol
from serving.replica_ready import PRELUDE, READY, READY_MARKERS, replica_ready
from serving.replicas import TABLE_READER, Replica, installed, shell_table
from serving.serving_host import UNITS_FACT, connect_address, env_path, unit_file

from .container import handed_gpus

FILES = Path(__file__).parent / "files"
ROLL = Protocol("the roll", markers={
    "waited": "MS: waited MS for another roll of the host to end (one whose run had lost its link)",
    "begin": "MS: the roll began",
    "drained": "MS LEFT: drained after MS, LEFT requests still in flight (the drain timeout)",
    "no-frontdoor": "no front door holds the replicas: nothing to drain",
    "gateways-saw": "seen|waited MS: the gateways had the host out for the pools it empties after MS (seen: each "
                    "gateway checking it had asked again; waited: the most a check takes)",
    "in-service": "INDEX MS: back in service",
    "undrain-failed": "INDEX SERVER: its front door refused to put it back in service",
    "unflag-failed": "FLAG: its front door refused to lower the roll's flag",
    "gate-passed": "INDEX VIA: its gate passed (through the front door, or on loopback)",
    "stopped": "MS: stopped, and seen down by its front door",
    "removed": "MS: disabled and removed",
    "replaced": "UNIT...: the units it ran under before, removed",
    "cleared": "INDEX PID...|none: unit reset, processes killed, container removed",
    "held": "INDEX: kept out of service once its gate passed (a trial)",
    "retagged": "the image tag was pointed back at the image that ran",
    **READY_MARKERS}, exits={"failed": 4, "rolled_back": 5, "rollback_failed": 6, "write_failed": 7}, result={
    "outcome": "done, failed, write-failed (nothing changed), rolled-back (back on what it ran, ready and in "
               "service) or rollback-failed",
    "ms": "when it ended", "why": "what failed (the action, the wait or the gate)",
    "units": "the unit that failed its wait, or those that did not answer in time", "failed_ms": "when it failed",
    "again": "why going back failed too", "ready_ms": "how long the replicas took to answer (blank: not waited for)"})
PROGRAM = Program((PRELUDE, RESULT_LIBRARY, *TABLE_READER, ADMIN_LIBRARY, READY, WRITE_FILE, FILES / "roll.sh"), ROLL)

THROTTLE = "rollout"
# one roll at a time on a host (files/roll.sh, step 0): its lock (a roll waits there as long as a roll
# of the host may take: Roll.lock_wait_s)
ROLL_LOCK = "/run/lock/dgemma-roll.lock"
ACTIONS = ("restart", "start", "stop", "recover", "remove")
GATED = ("restart", "start", "recover")


def fronted_by_gateway(ctx) -> bool:
    """Whether the run's fleet has a gateway (its users then see one service)."""
    fleet = ctx.services.get("fleet")
    return bool(fleet and fleet.has_gateway)


def fleet_throttle(ctx) -> Throttle:
    """`throttle` for the host in ``ctx``, as the run's fleet is."""
    return throttle(ctx.vars, fronted_by_gateway(ctx))


def throttle(v: dict, has_gateway: bool) -> Throttle:
    """How many rolls of the fleet run at once: ``rollout_concurrency``, by default one
    when a gateway fronts the fleet (its users see one service; each replica out is capacity
    out), else no fleet-wide limit (each host is its own endpoint; still one roll of a
    host at a time, so its front door keeps answering)."""
    limit = v.get("rollout_concurrency")
    return Throttle(THROTTLE, int(limit) if limit is not None else (1 if has_gateway else 0))


@dataclass(frozen=True)
class Roll:
    """One roll on one host: what it does to which replicas, and what its gate expects.
    ``unit_file``, ``unit_path``, ``image`` and ``same_image_ref`` are deploy's (one
    replica): what to write, and the image reference to point back at on the way back."""
    host: str
    runtime: str
    action: str
    replicas: tuple  # serving.replicas.Replica, with its GPUs
    env_path: str
    api_port: int  # the front door's (serving/fleet.py: frontdoor_port)
    frontdoor_address: str
    drain_timeout: int
    ready_timeout: int
    alone: bool  # no other replica of the host and no gateway: nobody answers while it is out
    gateway_wait: bool = False  # a gateway fronts the fleet: a pool leaving waits for its next check
    unit_file: File | None = None
    unit_path: str = ""
    image: str = ""  # the image reference the new unit names
    same_image_ref: bool = False  # the unit that runs now names that reference too (a moved tag is put back)
    remove_paths: tuple = ()  # remove, or a move: the files that go with the unit that goes
    started: bool = True  # recover: start it again afterwards (state: started)
    replaces: Replica | None = None  # deploy's move of a running replica to its family's name
    hold: bool = False  # a trial (invoke tune): once gated it stays out of service, until a deploy puts it back

    def __post_init__(self):
        if self.action not in ACTIONS:
            raise ValueError(f"unknown roll action {self.action!r}")
        if self.can_go_back and len(self.replicas) != 1:
            raise ValueError("a roll that can go back changes one replica")

    @property
    def units(self) -> str:
        return ", ".join(t.unit for t in self.replicas)

    @property
    def can_go_back(self) -> bool:
        """Deploy changed something (a unit, an image): a failed gate goes back to what ran."""
        return self.action == "restart" and (self.unit_file is not None or bool(self.image))

    @property
    def gates(self) -> bool:
        return self.action in GATED and (self.action != "recover" or self.started)

    @property
    def work_s(self) -> int:
        """The most this roll's own work takes: draining, then at most two starts and gates (the way
        back), and the rest."""
        return self.drain_timeout + 2 * (self.ready_timeout + 160) + 60

    @property
    def lock_wait_s(self) -> int:
        """How long it waits for another roll of its host to end (one whose run lost its link runs on):
        as long as such a roll may take, its host's replicas being this one's. A fixed bound shorter
        than that (it was 120 s) failed the next run's roll behind a roll that was only waiting for a
        cold start (vLLM's can take 140 s)."""
        return self.work_s

    def timeout(self) -> int:
        """Another roll's end, then its own."""
        return self.lock_wait_s + self.work_s


GATE_BODY = json.dumps({"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 8,
                        "chat_template_kwargs": {"enable_thinking": False}})


def script(roll: Roll) -> str:
    """The roll as the host's sh reads it (grouped: read whole before any of it runs)."""
    # no model named: the replica answers with its own (as vLLM does), whatever family it serves
    params = {"ACTION": roll.action, "REPLICAS": shell_table(roll.replicas), "RT": roll.runtime,
              "ENV_FILE": roll.env_path, **admin_parameters(), "FRONTDOOR_CA": FRONTDOOR_CA,
              "RESOLVE": f"{roll.host}:{roll.api_port}:{roll.frontdoor_address}",
              "GATE_URL": f"https://{roll.host}:{roll.api_port}/v1/chat/completions", "GATE_BODY": GATE_BODY,
              "DRAIN_TIMEOUT_MS": int(roll.drain_timeout) * 1000, "READY_TIMEOUT_S": int(roll.ready_timeout),
              "GATEWAY_WAIT": int(roll.gateway_wait), "START_AGAIN": int(roll.started), "GO_BACK": int(roll.can_go_back),
              "ROLL_LOCK": ROLL_LOCK, "ROLL_LOCK_WAIT_S": roll.lock_wait_s, "HOLD": int(roll.hold),
              "WRITE": int(roll.unit_file is not None), "UNIT_PATH": roll.unit_path,
              "REF": roll.image if roll.same_image_ref else "",
              "BEFORE_REPLICAS": shell_table([roll.replaces.with_gpus(roll.replicas[0].gpus)]) if roll.replaces else "",
              "REMOVE_PATHS": " ".join(roll.remove_paths)}
    # the new unit, written atomically by write_file.sh's write_file (roll.sh calls it when WRITE=1)
    write = f"write_unit() {{\n{roll.unit_file.write_call()}}}\n" if roll.unit_file is not None else ""
    return PROGRAM.script(params, before=write, grouped=True)


def command(roll: Roll, name: str, describe: str, *, throttle: Throttle | None = None, diff: str = "",
            satisfies: tuple = ()) -> Command:
    """The step that runs ``roll``; one that gates one replica produces `gated` for it."""
    return Command(name, script=script(roll), interpret=interpret(roll), describe=describe, diff=diff,
                   throttle=throttle, satisfies=satisfies, timeout=roll.timeout(),
                   produces=gated(roll.replicas[0].unit) if _produces(roll) else None)


def _produces(roll: Roll) -> bool:
    return roll.gates and len(roll.replicas) == 1


def plan_roll(ctx, action: str, replicas: list[Replica], **change) -> Roll:
    """A roll of ``replicas`` of the host in ``ctx``, as its variables and the run's fleet
    say; ``change``: deploy's (unit_file, unit_path, image, same_image_ref, replaces) or
    remove's (remove_paths)."""
    v = ctx.vars
    declared = ctx.results.get(UNITS)
    planned = declared.by_index() if declared else {}
    # its GPUs: the placement's, or (day 2, no placement) those its unit hands over
    targets = tuple(r if r.gpus else r.with_gpus(
        planned[r.index].replica.gpus if r.index in planned
        else handed_gpus((unit_file(ctx, r) or {}).get("content", ""))) for r in replicas)
    count = len(planned) or len(installed(v, ctx.facts.get(UNITS_FACT)))
    return Roll(host=ctx.name, runtime=v.get("container_runtime", "podman"), action=action, replicas=targets,
                env_path=env_path(v),
                api_port=frontdoor_port(v), frontdoor_address=connect_address(v),
                drain_timeout=int(v.get("drain_timeout", 120)), ready_timeout=int(v.get("ready_timeout", 600)),
                alone=count <= len(replicas) and not fronted_by_gateway(ctx), gateway_wait=fronted_by_gateway(ctx),
                started=v.get("state", "started") == "started",
                **change)


def at_once(limit: Throttle) -> str:
    """How many roll at once, in words."""
    return (f"{limit.limit} replica{'s' if limit.limit > 1 else ''} of the fleet at a time" if limit.limit
            else "one replica of this host at a time")


def _journal(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("  | ")]
    return "\n".join(dict.fromkeys(lines)) or "  | (no log lines)"


VERBS = {"restart": "rolled", "start": "started", "stop": "stopped", "recover": "recovered", "remove": "removed"}


def interpret(roll: Roll):
    """The roll's report: how long the replicas were out of service, or why it failed and
    whether they are back on what they ran. A gated roll produces its units (`gated`)."""
    def read(result):
        message = _said(roll, result)
        return Produced(roll.units, message) if _produces(roll) else message
    return read


def _seconds(ms) -> str:
    return f"{int(ms) / 1000:.1f}"


def _see(roll: Roll, fix: str = "recover") -> str:
    one = f" --replica {roll.replicas[0].index}" if len(roll.replicas) == 1 else ""
    return f"See: invoke logs --hosts {roll.host}{one}; invoke {fix} --hosts {roll.host}{one}"


def _ready(said: dict, out: str) -> str | None:
    """How long the replicas took to answer: the whole wait, and each one's when several."""
    if said["ready_ms"] == "":
        return None
    each = replica_ready(ROLL, out)
    return f"ready in {_seconds(said['ready_ms'])} s" + (
        f" ({', '.join(f'{unit} after {seconds:.1f} s' for unit, seconds in each.items())})" if len(each) > 1 else "")


def _not_back(roll: Roll, out: str):
    """A replica its front door would not put back in service, or a flag it would not lower: the
    roll fails, whatever it did, with what mends it."""
    refused = ROLL.every(out, "undrain-failed")
    if refused:
        which = ", ".join(f"replica {fields[0]} ({fields[1] if len(fields) > 1 else '?'})" for fields in refused)
        one = f" --replica {refused[0][0]}" if len(refused) == 1 else ""
        raise StepFailed(f"{roll.host}: the front door refused to put {which} back in service after its "
                         f"{roll.action}: it stays drained (no request reaches it) and the rollout stops here. "
                         f"Mend it: invoke recover --hosts {roll.host}{one}")
    flags = ROLL.every(out, "unflag-failed")
    if flags:
        raise StepFailed(f"{roll.host}: the front door refused to lower the roll's flag "
                         f"({', '.join(f[0] for f in flags)}): the gateways hold the host out, and the rollout stops "
                         f"here. Mend it: invoke deploy --hosts {roll.host} (it lowers a flag left up)")


def _said(roll: Roll, result) -> str:
    out = result.stdout
    try:
        said = ROLL.result_of(out)
    except ProgramResultError as exc:
        raise StepFailed(f"the {roll.action} of {roll.units} on {roll.host} ended with exit {result.rc} and "
                         f"no result ({exc}); its replicas may be drained: {_see(roll)}") from None
    _not_back(roll, out)
    begin = ROLL.first(out, "begin")

    def since_begin(ms: str) -> str:
        return f"{(int(ms) - int(begin[0])) / 1000:.1f}" if begin else "?"
    outcome = said["outcome"]
    waited = ROLL.first(out, "waited")
    if outcome == "done":
        drained = ROLL.first(out, "drained")
        saw = ROLL.first(out, "gateways-saw")
        parts = ([f"waited {_seconds(waited[0])} s for another roll of the host to end"] if waited else []) + [
                 f"drained in {_seconds(drained[0])} s"
                 + (f" ({drained[1]} still in flight after drain_timeout)" if drained[1] != "0" else "")
                 + (f", once the gateways had the host out ({_seconds(saw[1])} s"
                    + ("; not seen, the most a check takes)" if saw[0] != "seen" else ")") if saw else "")
                 if drained else "no front door yet: nothing to drain" if ROLL.first(out, "no-frontdoor") is not None
                 else "not drained"]
        cleared = ROLL.every(out, "cleared")
        if cleared:
            parts.append("; ".join(f"replica {c[0]}: unit stopped and reset, "
                                   f"{'killed ' + ' '.join(c[1:]) if c[1:] != ['none'] else 'no process left'}, "
                                   f"container removed" for c in cleared))
        ready = _ready(said, out)
        if ready is not None:
            parts.append(f"{'new unit, ' if roll.unit_file is not None else ''}"
                         f"{'restarted' if roll.action == 'restart' else 'started'}, {ready}")
            vias = sorted({" ".join(g[1:]) for g in ROLL.every(out, "gate-passed")})
            parts.append(f"gate passed ({', '.join(vias) or '?'}, its checks)")
        stopped = ROLL.first(out, "stopped")
        if stopped is not None:
            parts.append(f"stopped, seen down {since_begin(stopped[0])} s after the roll began")
        if ROLL.first(out, "removed") is not None:
            parts.append("disabled and removed")
        replaced = ROLL.first(out, "replaced")
        if replaced:
            parts.append(f"it ran as {' '.join(replaced)} before, now removed")
        back = ROLL.every(out, "in-service")
        if back:
            parts.append(f"out of service {since_begin(str(max(int(b[1]) for b in back)))} s")
        held = ROLL.every(out, "held")
        if held:
            parts.append(f"held out of service (a trial: no user's request reaches "
                         f"{'it' if len(held) == 1 else 'them'}; invoke deploy --hosts {roll.host} puts it back)")
        down = (f"; {roll.host} served no request while it {'restarted' if roll.gates else 'was out'} "
                f"(one replica, no gateway)" if roll.alone else "")
        return f"{roll.units} {VERBS[roll.action]}: {'; '.join(parts)}{down}"
    if outcome == "write-failed":
        raise StepFailed(f"writing {roll.unit_path} failed; {roll.units} was not restarted and is back in service")
    if outcome == "failed" and begin is None:  # it never began: another roll of the host held the lock throughout
        raise StepFailed(f"the {roll.action} of {roll.units} on {roll.host} did not begin, and nothing was changed: "
                         f"{said['why']} (a roll whose run lost its link runs on to its end: its replicas' units "
                         f"restart meanwhile, `invoke logs --hosts {roll.host}` shows them). Run this again once it "
                         f"has ended")
    why = said["why"] or f"exit {result.rc}: {(out + result.stderr).strip()[-300:]}"
    logs = _journal(out)
    named = ", ".join(str(said["units"]).split()) or roll.units
    if outcome == "rolled-back":
        took = (f" {(int(said['ms']) - int(said['failed_ms'])) / 1000:.1f} s after the failure"
                if str(said["failed_ms"]).isdigit() else "")
        raise StepFailed(
            f"{roll.units} failed its gate: {why}. It was rolled back to what it ran before (its unit"
            f"{', and the image it ran, retagged' if ROLL.first(out, 'retagged') is not None else ''}) and is ready"
            f"{' and in service' if ROLL.first(out, 'in-service') is not None else ''} again{took}. The rollout "
            f"stops here: the replicas not rolled yet were not changed. Last log lines of the failed "
            f"release:\n{logs}")
    if outcome == "rollback-failed":
        again = said["again"] or "?"
        raise StepFailed(f"{roll.units} failed its gate: {why}; going back to what it ran failed too ({again}). "
                         f"Last log lines:\n{logs}\n{_see(roll)}")
    if roll.gates:
        raise StepFailed(f"{named} did not come back after {'its restart' if roll.action == 'restart' else roll.action}: "
                         f"{why}. It is back in the front door's rotation, which holds it out while it does not "
                         f"answer; the rollout stops here. Last log lines:\n{logs}\n{_see(roll)}")
    raise StepFailed(f"{roll.action} of {roll.units} failed: {why}. Last log lines:\n{logs}\n{_see(roll)}")
