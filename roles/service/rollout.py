"""The one way a running replica is changed: a roll. Out of service in its host's
front door (and so, when it was the host's last, in the gateway), the action, the
gate where it comes back, back in service. Every change that stops a replica goes
through it: deploy's changes that need a restart, and day 2's restart, stop, start
and recover, and a replica removed because its GPU became busy.

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

Everything between "drained" and "back in service" is one script on the host, so a
lost link or Ctrl-C on the control machine never leaves a replica half-changed or
drained: the script ignores SIGHUP and finishes (or rolls back) on its own.

How the gateway learns of it: the script raises the front door's rolling flag
(roles/frontdoor/admin.py); while it is up and no replica of the host is in service,
/health answers 404 and the gateway holds the host out of balancing
(``disable-on-404``: DRAIN in ``invoke status``) for the whole roll. It needs no
connection to the gateway, so ``--hosts rtx01`` drains it there too. Pure."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from converge.changes import Command, File, Output, Produced, Throttle
from converge.errors import StepFailed

from roles.frontdoor.admin import ADMIN_SOCKET, FRONTDOOR_CA, FRONTDOOR_SHELL
from roles.frontdoor.render import GATEWAY_CHECK_INTERVAL_S, GATEWAY_SEES_FLAG_S
from roles.replicas import installed, replica_name, replica_port, replica_unit
from roles.serving_host import connect_address, env_path, unit_file

from .container import handed_gpus

from .ready import AWAIT_READY, entries, failed_unit, late_units, prelude

THROTTLE = "rollout"
ACTIONS = ("restart", "start", "stop", "recover", "remove")
GATED = ("restart", "start", "recover")


def is_running(unit_state: dict | None) -> bool:
    unit_state = unit_state or {}
    return unit_state.get("ActiveState") == "active" and unit_state.get("SubState") == "running"


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


def gated(unit: str) -> Output:
    """What a roll that gated ``unit`` produces: the start role does not wait for it again."""
    return Output(f"gated {unit}", str)


@dataclass(frozen=True)
class Target:
    """One replica a roll acts on."""
    index: int
    unit: str
    container: str
    port: int
    gpus: tuple = ()


@dataclass(frozen=True)
class Roll:
    """One roll on one host: what it does to which replicas, and what its gate expects.
    ``unit_file``, ``unit_path``, ``image`` and ``same_image_ref`` are deploy's (one
    replica): what to write, and the image reference to point back at on the way back."""
    host: str
    runtime: str
    action: str
    replicas: tuple  # Target
    env_path: str
    api_port: int
    frontdoor_address: str
    drain_timeout: int
    ready_timeout: int
    alone: bool  # no other replica of the host and no gateway: nobody answers while it is out
    gateway_wait: bool = False  # a gateway fronts the fleet: a pool leaving waits for its next check
    unit_file: File | None = None
    unit_path: str = ""
    image: str = ""  # the image reference the new unit names
    same_image_ref: bool = False  # the unit that runs now names that reference too (a moved tag is put back)
    remove_paths: tuple = ()  # remove: the files that go with the unit
    started: bool = True  # recover: start it again afterwards (state: started)

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

    def timeout(self) -> int:
        """Draining, then at most two starts and gates (the way back), and the rest."""
        return self.drain_timeout + 2 * (self.ready_timeout + 160) + 60


def script(roll: Roll) -> str:
    q = shlex.quote
    # no model named: the replica answers with its own (as vLLM does), whatever family it serves
    body = ('{"messages": [{"role": "user", "content": "Say OK."}], '
            '"max_tokens": 8, "chat_template_kwargs": {"enable_thinking": false}}')
    resolve = q(f"{roll.host}:{roll.api_port}:{roll.frontdoor_address}")
    url = q(f"https://{roll.host}:{roll.api_port}/v1/chat/completions")
    # each replica a function that sets its variables: POSIX sh has no arrays
    selectors = "\n".join(
        f"r{t.index}() {{ I={int(t.index)}; U={q(t.unit)}; C={q(t.container)}; P={int(t.port)}; "
        f"WANT_GPUS={q(' '.join(sorted(t.gpus)))}; }}" for t in roll.replicas)
    each = " ".join(f"r{t.index}" for t in roll.replicas)
    units = " ".join(q(t.unit) for t in roll.replicas)
    ready_args = entries([(t.unit, t.port) for t in roll.replicas])
    return f"""
# one group: sh reads all of it before running any of it, so a script cut short on its way
# (a link lost mid-send) runs nothing, rather than a drain or a write without what follows
{{
# what happens here must finish even if the control machine goes away
trap '' HUP PIPE
RT={q(roll.runtime)}; ADMIN={q(ADMIN_SOCKET)}; REF={q(roll.image) if roll.same_image_ref else "''"}
{prelude(roll.env_path)}
journal() {{ for j in {units}; do [ {len(roll.replicas)} -gt 1 ] && echo "  | -- $j"; journalctl -u "$j" -n 25 --no-pager -o cat --since "@$1" 2>/dev/null | sed 's/^/  | /'; done; }}
{FRONTDOOR_SHELL.strip()}
{selectors}
EACH={q(each)}
drained=""; flagged=0; leaving=""
is_drained() {{ case " $drained " in *" $I "*) return 0;; esac; return 1; }}
undrain() {{
  for i in $drained; do r$i; if admin ready; then say "@in-service $I $(now_ms)"; else say "@undrain-failed $I"; fi; done
  drained=""
  if [ $flagged = 1 ]; then flag maint; flagged=0; fi
  for p in $leaving; do pool_flag "$p" maint; done; leaving=""
}}
trap undrain EXIT
{AWAIT_READY.strip()}
say "@begin $(now_ms)"

# 1. out of service: the host's rolling flag up (the gateway holds it out while none is in
# service), then no new requests for these replicas; those in flight finish (up to drain_timeout)
# the last replicas in service of a family here: its pool's flag first, and the gateway's next
# check (each pool every {GATEWAY_CHECK_INTERVAL_S:g} s, a check taking up to its timeout) takes the host out
# for it before they drain
if [ -S "$ADMIN" ]; then
  ids=" "; for r in $EACH; do $r; ids="$ids$I "; done
  for p in $(leaving_pools "$ids"); do pool_flag "$p" ready && leaving="$leaving $p"; done
  if [ -n "$leaving" ] && [ {int(roll.gateway_wait)} = 1 ]; then sleep {GATEWAY_SEES_FLAG_S:g}; fi
fi
for r in $EACH; do
  $r
  if [ -S "$ADMIN" ] && [ -n "$(fd_state)" ]; then
    [ $flagged = 1 ] || {{ flag ready && flagged=1; }}
    admin drain && drained="$drained $I"
  fi
done
if [ -n "$drained" ]; then
  start=$(now_ms)
  while :; do
    left=0; for i in $drained; do r$i; set -- $(fd_state); left=$(( left + ${{1:-0}} )); done
    if [ "$left" = 0 ] || [ $(( $(now_ms) - start )) -ge {int(roll.drain_timeout) * 1000} ]; then break; fi
    sleep 0.2
  done
  say "@drained $(( $(now_ms) - start )) $left"
else
  say "@no-frontdoor"
fi

gate() {{
  answer=$(mktemp); via=loopback
  if is_drained; then
    # through the front door, pinned to this replica: first the front door must see it up. It
    # answered here, so it is up: said at once (hrunn), not after the front door's next checks
    # (its own checks go on, and would take it down again if it failed them)
    admin hrunn
    start=$(now_ms)
    while :; do
      set -- $(fd_state); state=${{2:-}}
      if [ "$state" = DRAIN ] || [ "$state" = UP ]; then break; fi
      if [ $(( $(now_ms) - start )) -ge 30000 ]; then why="the front door did not see it up within 30 s ($state)"; rm -f "$answer"; return 1; fi
      sleep 0.3
    done
  fi
  if is_drained && [ -n "$key" ]; then
    via="the front door"
    code=$(auth | curl -sS -K - -o "$answer" -w '%{{http_code}}' --max-time 120 --cacert {q(FRONTDOOR_CA)} --resolve {resolve} \\
      -H "X-Dgemma-Replica: $I" -H 'Content-Type: application/json' --data {q(body)} {url} 2>&1)
  else
    code=$(auth | curl -sS -K - -o "$answer" -w '%{{http_code}}' --max-time 120 -H 'Content-Type: application/json' \\
      --data {q(body)} "http://127.0.0.1:$P/v1/chat/completions" 2>&1)
  fi
  if [ "$code" != 200 ] || ! grep -q '"choices"' "$answer"; then
    why="a chat completion through $via answered ${{code:-nothing}}: $(head -c 200 "$answer" | tr '\\n' ' ')"; rm -f "$answer"; return 1
  fi
  rm -f "$answer"
  # its verify checks that a release can break: vLLM on loopback only, its own GPUs only
  open=$(ss -Hltn "sport = :$P" 2>/dev/null | awk '{{print $4}}' | grep -v -e '^127\\.0\\.0\\.1:' -e '^\\[::1\\]:' | head -n 1)
  if [ -n "$open" ]; then why="it listens on $open, not on loopback only"; return 1; fi
  if [ -n "$WANT_GPUS" ]; then
    seen=$($RT exec "$C" nvidia-smi -L 2>/dev/null | sed -n 's/.*(UUID: \\([^)]*\\)).*/\\1/p' | sort | tr '\\n' ' ' | sed 's/ $//')
    if [ "$seen" != "$WANT_GPUS" ]; then why="it sees GPUs '$seen', not its own '$WANT_GPUS'"; return 1; fi
  fi
  say "@gate-passed $I $via"
}}
# every replica of the roll ready (one readiness loop), then each through its gate
come_back() {{
  await_ready {int(roll.ready_timeout)} {ready_args} || return 1
  for r in $EACH; do $r; gate || {{ why="replica $I: $why"; return 1; }}; done
}}
# a stopped replica is back in the front door's rotation once its checks see it down
await_down() {{
  for r in $EACH; do
    $r; is_drained || continue; start=$(now_ms)
    while :; do
      set -- $(fd_state); case "${{2:-}}" in DOWN*|MAINT*|"") break;; esac
      [ $(( $(now_ms) - start )) -ge 15000 ] && break
      sleep 0.3
    done
  done
}}
{_action(roll)}
}}
"""


def _action(roll: Roll) -> str:
    """Step 2 of the script, the action, and how it ends (exit codes read by `interpret`)."""
    q = shlex.quote
    units = " ".join(q(t.unit) for t in roll.replicas)
    if roll.action == "stop":
        return f"""failed_at=$(date +%s)
# a container whose runtime exits non-zero as it is stopped leaves the unit "failed": it was asked to stop
if systemctl stop {units}; then systemctl reset-failed {units} 2>/dev/null; await_down; say "@stopped $(now_ms)"
  undrain; say "@done $(now_ms)"; exit 0; fi
why="systemctl stop failed"; say "@action-failed $why"; journal $failed_at; exit 4"""
    if roll.action == "remove":
        paths = " ".join(q(p) for p in roll.remove_paths)
        return f"""systemctl disable --now {units} 2>/dev/null; systemctl reset-failed {units} 2>/dev/null
rm -f {paths}
systemctl daemon-reload
await_down; say "@removed $(now_ms)"; undrain; say "@done $(now_ms)"; exit 0"""
    if roll.action == "recover":
        clear = "\n".join(_clear(roll.runtime, t) for t in roll.replicas)
        come_back = (f"""failed_at=$(date +%s)
systemctl reset-failed {units} 2>/dev/null
if systemctl start {units} && come_back; then undrain; say "@done $(now_ms)"; exit 0; fi
say "@gate-failed $(now_ms) $why"; journal $failed_at; exit 4""" if roll.started else
                     'await_down; undrain; say "@done $(now_ms)"; exit 0')
        return f"{clear}\n{come_back}"
    if roll.action == "start":
        return f"""failed_at=$(date +%s)
systemctl reset-failed {units} 2>/dev/null
if systemctl start {units} && come_back; then undrain; say "@done $(now_ms)"; exit 0; fi
say "@gate-failed $(now_ms) ${{why:-systemctl start failed}}"; journal $failed_at; exit 4"""
    # restart: deploy's change (one replica, with a way back) or day 2's
    restart = f"""restart() {{ systemctl reset-failed {units} 2>/dev/null; systemctl restart {units} || {{ why="systemctl restart failed"; return 1; }}; }}
failed_at=$(date +%s)"""
    if not roll.can_go_back:
        return f"""{restart}
if restart && come_back; then undrain; say "@done $(now_ms)"; exit 0; fi
say "@gate-failed $(now_ms) $why"; journal $failed_at; exit 4"""
    write = roll.unit_file.script() if roll.unit_file is not None else ""
    target = roll.replicas[0]
    return f"""# what runs now, to go back to: the unit (kept as .previous when rewritten) and the image by its id
r{target.index}
old_image=$($RT inspect --format '{{{{.Image}}}}' "$C" 2>/dev/null)
wrote=0
{_subshell(write, "wrote=1", "say '@write-failed'; exit 7") if write else ""}
systemctl daemon-reload
{restart}
if restart && come_back; then
  undrain; say "@done $(now_ms)"; exit 0
fi
failed_at_ms=$(now_ms)
say "@gate-failed $failed_at_ms $why"
journal $failed_at
# back to exactly what ran: its unit, and the image it ran (a moved tag names it again)
if [ $wrote = 1 ]; then mv -f {q(roll.unit_path + ".previous")} {q(roll.unit_path)}; fi
if [ -n "$old_image" ] && [ -n "$REF" ]; then
  now_id=$($RT image inspect --format '{{{{.Id}}}}' "$REF" 2>/dev/null)
  if [ "${{now_id#sha256:}}" != "${{old_image#sha256:}}" ]; then $RT tag "$old_image" "$REF" && say "@retagged"; fi
fi
systemctl daemon-reload
if restart && come_back; then
  undrain; say "@rolled-back $(now_ms)"; exit 5
fi
say "@rollback-failed $why"
journal $failed_at
exit 6"""


def _clear(runtime: str, target: Target) -> str:
    """One replica's unit stopped and reset (ends a restart loop), its container's processes
    killed, the container removed; each said as it is done."""
    q = shlex.quote
    unit, cname, rt = q(target.unit), q(target.container), q(runtime)
    # podman: the container's process and its conmon; docker: its process (containerd's shim
    # reaps it), then docker's own SIGKILL
    pids = "{{.State.Pid}} {{.State.ConmonPid}}" if runtime == "podman" else "{{.State.Pid}}"
    also = "" if runtime == "podman" else f"{rt} kill --signal KILL {cname} >/dev/null 2>&1 && killed=\"$killed docker-kill\"; "
    # podman waits at most 1 s for a stop (seed 000); docker's rm -f kills at once
    rm = f"{rt} rm -f --time 1 {cname}" if runtime == "podman" else f"{rt} rm -f {cname}"
    return (f"timeout 120 systemctl stop {unit}; systemctl kill -s KILL {unit} 2>/dev/null\n"
            f"systemctl reset-failed {unit} 2>/dev/null\n"
            f"killed=\"\"; for p in $({rt} inspect --format {q(pids)} {cname} 2>/dev/null | tr ' ' '\\n' "
            f"| grep -v '^0$' | grep -v '^$'); do kill -9 $p 2>/dev/null && killed=\"$killed $p\"; done; {also}\n"
            f"timeout 60 {rm} >/dev/null 2>&1\n"
            f"if {rt} inspect {cname} >/dev/null 2>&1; then say \"@clear-failed {int(target.index)} the container "
            f"is still there\"; exit 4; fi\n"
            f"say \"@cleared {int(target.index)}${{killed:- none}}\"")


def command(roll: Roll, name: str, describe: str, *, throttle: Throttle | None = None, diff: str = "",
            satisfies: tuple = ()) -> Command:
    """The step that runs ``roll``; one that gates one replica produces `gated` for it."""
    return Command(name, script=script(roll), interpret=interpret(roll), describe=describe, diff=diff,
                   throttle=throttle, satisfies=satisfies, timeout=roll.timeout(),
                   produces=gated(roll.replicas[0].unit) if _produces(roll) else None)


def _produces(roll: Roll) -> bool:
    return roll.gates and len(roll.replicas) == 1


def plan_roll(ctx, action: str, indices: list[int], **change) -> Roll:
    """A roll of the replicas ``indices`` of the host in ``ctx``, as its variables and the
    run's fleet say; ``change``: deploy's (unit_file, unit_path, image, same_image_ref) or
    remove's (remove_paths)."""
    v = ctx.vars
    planned = {r["index"]: r for r in ctx.desired.get("replicas") or []}
    # its GPUs: the placement's, or (day 2, no placement) those its unit hands over
    targets = tuple(Target(i, replica_unit(v, i), replica_name(v, i), replica_port(v, i),
                           tuple((planned.get(i) or {}).get("gpus")
                                 or handed_gpus((unit_file(ctx, i) or {}).get("content", "")))) for i in indices)
    count = len(planned) or len(installed(v, ctx.facts.get("unit"), ctx.facts.get("replica_units")))
    return Roll(host=ctx.name, runtime=v.get("container_runtime", "podman"), action=action, replicas=targets,
                env_path=env_path(v),
                api_port=int(v.get("api_port", 8000)), frontdoor_address=connect_address(v),
                drain_timeout=int(v.get("drain_timeout", 120)), ready_timeout=int(v.get("ready_timeout", 600)),
                alone=count <= len(indices) and not fronted_by_gateway(ctx), gateway_wait=fronted_by_gateway(ctx),
                started=v.get("state", "started") == "started",
                **change)


def at_once(limit: Throttle) -> str:
    """How many roll at once, in words."""
    return (f"{limit.limit} replica{'s' if limit.limit > 1 else ''} of the fleet at a time" if limit.limit
            else "one replica of this host at a time")


def _subshell(text: str, then: str, otherwise: str) -> str:
    """``text`` in a subshell (its ``set -e`` and traps stay there), as written: a heredoc in
    it ends at a line of its own."""
    return f"(\n{text.strip()}\n) && {then} || {{ {otherwise}; }}"


def _marker(out: str, name: str) -> list[str] | None:
    match = re.search(rf"^@{name}(?: (.*))?$", out, re.M)
    return None if match is None else (match.group(1) or "").split()


def _markers(out: str, name: str) -> list[list[str]]:
    return [(m.group(1) or "").split() for m in re.finditer(rf"^@{name}(?: (.*))?$", out, re.M)]


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


def _said(roll: Roll, result) -> str:
    out = result.stdout
    begin = _marker(out, "begin")
    drained = _marker(out, "drained")
    ready = _marker(out, "ready")
    host, first = roll.host, roll.replicas[0]

    def since_begin(ms: str) -> str:
        return f"{(int(ms) - int(begin[0])) / 1000:.1f}" if begin else "?"
    if result.rc == 0 and _marker(out, "done") is not None:
        drain = (f"drained in {int(drained[0]) / 1000:.1f} s"
                 + (f" ({drained[1]} still in flight after drain_timeout)" if drained[1] != "0" else "")
                 if drained else "no front door yet: nothing to drain")
        parts = [drain]
        cleared = _markers(out, "cleared")
        if cleared:
            parts.append("; ".join(f"replica {c[0]}: unit stopped and reset, "
                                   f"{'killed ' + ' '.join(c[1:]) if c[1:] != ['none'] else 'no process left'}, "
                                   f"container removed" for c in cleared))
        if ready is not None:
            parts.append(f"{'new unit, ' if roll.unit_file is not None else ''}"
                         f"{'restarted' if roll.action == 'restart' else 'started'}, ready in "
                         f"{int(ready[0]) / 1000:.1f} s")
            vias = sorted({" ".join(g[1:]) for g in _markers(out, "gate-passed")})
            parts.append(f"gate passed ({', '.join(vias) or '?'}, its checks)")
        elif roll.action == "remove":
            parts.append("disabled and removed")
        back = _markers(out, "in-service")
        if back:
            parts.append(f"out of service {since_begin(str(max(int(b[1]) for b in back)))} s")
        down = (f"; {host} served no request while it {'restarted' if roll.gates else 'was out'} "
                f"(one replica, no gateway)" if roll.alone else "")
        return f"{roll.units} {VERBS[roll.action]}: {'; '.join(parts)}{down}"
    if _marker(out, "write-failed") is not None:
        raise StepFailed(f"writing {roll.unit_path} failed; {roll.units} was not restarted and is back in service")
    failed = re.search(r"^@gate-failed (\d+) (.*)$", out, re.M)
    action_failed = _marker(out, "action-failed") or _marker(out, "clear-failed")
    why = (failed.group(2) if failed else " ".join(action_failed) if action_failed
           else f"exit {result.rc}: {(out + result.stderr).strip()[-300:]}")
    logs = _journal(out)
    see = (f"See: invoke logs --hosts {host}{f' --replica {first.index}' if len(roll.replicas) == 1 else ''}; "
           f"invoke recover --hosts {host}{f' --replica {first.index}' if len(roll.replicas) == 1 else ''}")
    which = failed_unit(out)
    late = late_units(out)
    named = which[0] if which else ", ".join(late) if late else roll.units
    if result.rc == 5:
        back = _marker(out, "rolled-back")
        took = f" {(int(back[0]) - int(failed.group(1))) / 1000:.1f} s after the failure" if back and failed else ""
        raise StepFailed(
            f"{roll.units} failed its gate: {why}. It was rolled back to what it ran before (its unit"
            f"{', and the image it ran, retagged' if _marker(out, 'retagged') is not None else ''}) and is ready"
            f"{' and in service' if _marker(out, 'in-service') is not None else ''} again{took}. The rollout "
            f"stops here: the replicas not rolled yet were not changed. Last log lines of the failed "
            f"release:\n{logs}")
    if result.rc == 6:
        again = " ".join(_marker(out, "rollback-failed") or ["?"])
        raise StepFailed(f"{roll.units} failed its gate: {why}; going back to what it ran failed too ({again}). "
                         f"Last log lines:\n{logs}\n{see}")
    if roll.gates:
        raise StepFailed(f"{named} did not come back after {'its restart' if roll.action == 'restart' else roll.action}: "
                         f"{why}. It is back in the front door's rotation, which holds it out while it does not "
                         f"answer; the rollout stops here. Last log lines:\n{logs}\n{see}")
    raise StepFailed(f"{roll.action} of {roll.units} failed: {why}. Last log lines:\n{logs}\n{see}")
