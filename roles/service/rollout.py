"""A running replica whose change needs a restart is rolled, not restarted: out
of service in its host's front door (and so, when it was the host's last, in the
gateway), the change written, restarted, gated, back in service. A replica that
fails its gate goes back to exactly the unit and image it ran, is gated again and
put back; the step fails and the run's rollout stops there.

Everything between "drained" and "back in service" is one script on the host, so
a lost link or Ctrl-C on the control machine never leaves a replica half-changed
or drained: the script ignores SIGHUP and finishes (or rolls back) on its own.

How the gateway learns of it: the front door answers its /health with 404 while
every replica it has is drained, and the gateway takes a server that answers 404
out of balancing (HAProxy's `http-check disable-on-404`: DRAIN in `invoke status`)
while its requests in flight finish; it needs no connection to the gateway, so a
deploy of one host (`--hosts rtx01`) drains it there too. Pure."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

from converge.changes import File, Throttle
from converge.errors import StepFailed

from roles.frontdoor.render import FRONTDOOR, admin_socket

THROTTLE = "rollout"
ADMIN_SOCKET = admin_socket(FRONTDOOR)  # the front door's stats page with admin actions (root only)
FRONTDOOR_CA = f"{FRONTDOOR.dir}/ca.crt"


# replica $I in the front door whose stats page with admin actions is at $ADMIN
FRONTDOOR_SHELL = r"""
# drain or ready (HAProxy's stats page answers a POST with a redirect ending in ;st=DONE)
admin() { curl -sS --max-time 5 --unix-socket "$ADMIN" -D - -o /dev/null --data "s=replica$I&b=servers&action=$1" \
  http://frontdoor/ 2>/dev/null | grep -q 'st=DONE'; }
# requests queued or in flight there, and its state (UP, DRAIN, DOWN...)
fd_state() { curl -sS --max-time 5 --unix-socket "$ADMIN" 'http://frontdoor/;csv' 2>/dev/null \
  | awk -F, -v s="replica$I" '$1 == "servers" && $2 == s { print $3 + $5, $18; exit }'; }
"""


def is_running(unit_state: dict | None) -> bool:
    unit_state = unit_state or {}
    return unit_state.get("ActiveState") == "active" and unit_state.get("SubState") == "running"


def throttle(v: dict, has_gateway: bool) -> Throttle:
    """How many replicas of the fleet roll at once: ``rollout_concurrency``, by default one
    when a gateway fronts the fleet (its users see one service; each replica out is capacity
    out), else no fleet-wide limit (each host is its own endpoint; still one replica of a
    host at a time, so its front door keeps answering)."""
    limit = v.get("rollout_concurrency")
    return Throttle(THROTTLE, int(limit) if limit is not None else (1 if has_gateway else 0))


@dataclass(frozen=True)
class Roll:
    """One replica's roll: what to write (None: only a restart), and what its gate expects."""
    host: str
    runtime: str
    index: int
    unit: str
    unit_path: str
    container: str
    port: int
    gpus: tuple
    env_path: str
    unit_file: File | None
    image: str  # the image reference the new unit names
    same_image_ref: bool  # the unit that runs now names that reference too (a moved tag is put back)
    served_model_name: str
    api_port: int
    frontdoor_address: str
    drain_timeout: int
    ready_timeout: int
    alone: bool  # no other replica of the host and no gateway: nobody answers while it restarts


def script(roll: Roll) -> str:
    q = shlex.quote
    write = roll.unit_file.script() if roll.unit_file is not None else ""
    ref = q(roll.image) if roll.same_image_ref else "''"
    body = ('{"model": ' + f'"{roll.served_model_name}"' + ', "messages": [{"role": "user", "content": "Say OK."}], '
            '"max_tokens": 8, "chat_template_kwargs": {"enable_thinking": false}}')
    want_gpus = " ".join(sorted(roll.gpus))
    resolve = q(f"{roll.host}:{roll.api_port}:{roll.frontdoor_address}")
    url = q(f"https://{roll.host}:{roll.api_port}/v1/chat/completions")
    return f"""
# one group: sh reads all of it before running any of it, so a script cut short on its way
# (a link lost mid-send) runs nothing, rather than a drain or a write without what follows
{{
# what happens here must finish even if the control machine goes away
trap '' HUP PIPE
U={q(roll.unit)}; C={q(roll.container)}; P={int(roll.port)}; I={int(roll.index)}; RT={q(roll.runtime)}
ADMIN={q(ADMIN_SOCKET)}; REF={ref}; WANT_GPUS={q(want_gpus)}
say() {{ echo "$@" 2>/dev/null; }}
now_ms() {{ echo $(( $(date +%s%N) / 1000000 )); }}
journal() {{ journalctl -u "$U" -n 25 --no-pager -o cat --since "@$1" 2>/dev/null | sed 's/^/  | /'; }}
{FRONTDOOR_SHELL.strip()}
drained=0
undrain() {{ if [ $drained = 1 ]; then drained=0; if admin ready; then say "@in-service $(now_ms)"; else say "@undrain-failed"; fi; fi; }}
trap undrain EXIT
# the key is read into a variable and given to curl on stdin: never on a command line
key=$(sed -n 's/^VLLM_API_KEY=//p' {q(roll.env_path)} 2>/dev/null)
auth() {{ printf 'header = "Authorization: Bearer %s"\\n' "$key"; }}
say "@begin $(now_ms)"

# 1. out of service: no new requests; those in flight finish (up to drain_timeout)
if [ -S "$ADMIN" ] && [ -n "$(fd_state)" ] && admin drain; then
  drained=1; start=$(now_ms)
  while :; do
    set -- $(fd_state); left=${{1:-0}}
    if [ "$left" = 0 ] || [ $(( $(now_ms) - start )) -ge {int(roll.drain_timeout) * 1000} ]; then break; fi
    sleep 0.2
  done
  say "@drained $(( $(now_ms) - start )) $left"
else
  say "@no-frontdoor"
fi

# 2. what runs now, to go back to: the unit (kept as .previous when rewritten) and the image by its id
old_image=$($RT inspect --format '{{{{.Image}}}}' "$C" 2>/dev/null)
wrote=0
{_subshell(write, "wrote=1", "say '@write-failed'; exit 7") if write else ""}
systemctl daemon-reload

restart_and_wait() {{
  why=""; since=$(date +%s); systemctl reset-failed "$U" 2>/dev/null
  systemctl restart "$U" || {{ why="systemctl restart $U failed"; return 1; }}
  n0=$(systemctl show -p NRestarts --value "$U"); start=$(now_ms)
  while :; do
    el=$(( ($(now_ms) - start) / 1000 ))
    active=$(systemctl show -p ActiveState --value "$U"); sub=$(systemctl show -p SubState --value "$U")
    n=$(systemctl show -p NRestarts --value "$U")
    if [ "$active" = failed ] || [ "$active" = inactive ] || [ "$sub" = auto-restart ] || [ "$n" != "$n0" ]; then
      why="its container exited after $el s ($active/$sub)"; return 1
    fi
    if curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$P/health" 2>/dev/null &&
       auth | curl -fsS --max-time 5 -K - -o /dev/null "http://127.0.0.1:$P/v1/models" 2>/dev/null; then
      say "@ready $(( $(now_ms) - start ))"; return 0
    fi
    if [ $el -ge {int(roll.ready_timeout)} ]; then why="no answer on /health and /v1/models within {int(roll.ready_timeout)} s"; return 1; fi
    sleep 0.3
  done
}}

gate() {{
  answer=$(mktemp); via=loopback
  if [ $drained = 1 ]; then
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
  if [ $drained = 1 ] && [ -n "$key" ]; then
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
  say "@gate-passed $via"
}}

# 3. the change: restart, then the gate
failed_at=$(date +%s)
if restart_and_wait && gate; then
  undrain; say "@done $(now_ms)"; exit 0
fi
failed_at_ms=$(now_ms)
say "@gate-failed $failed_at_ms $why"
journal $failed_at
# 4. back to exactly what ran: its unit, and the image it ran (a moved tag names it again)
if [ $wrote = 1 ]; then mv -f {q(roll.unit_path + ".previous")} {q(roll.unit_path)}; fi
if [ -n "$old_image" ] && [ -n "$REF" ]; then
  now_id=$($RT image inspect --format '{{{{.Id}}}}' "$REF" 2>/dev/null)
  if [ "${{now_id#sha256:}}" != "${{old_image#sha256:}}" ]; then $RT tag "$old_image" "$REF" && say "@retagged"; fi
fi
systemctl daemon-reload
if restart_and_wait && gate; then
  undrain; say "@rolled-back $(now_ms)"; exit 5
fi
say "@rollback-failed $why"
journal $failed_at
exit 6
}}
"""


def _subshell(text: str, then: str, otherwise: str) -> str:
    """``text`` in a subshell (its ``set -e`` and traps stay there), as written: a heredoc in
    it ends at a line of its own."""
    return f"(\n{text.strip()}\n) && {then} || {{ {otherwise}; }}"


def _marker(out: str, name: str) -> list[str] | None:
    match = re.search(rf"^@{name}(?: (.*))?$", out, re.M)
    return None if match is None else (match.group(1) or "").split()


def _journal(out: str) -> str:
    lines = [line for line in out.splitlines() if line.startswith("  | ")]
    return "\n".join(dict.fromkeys(lines)) or "  | (no log lines)"


def interpret(roll: Roll):
    """The roll's report: how long the replica was out of service, or why it failed and
    whether it is back on what it ran."""
    def read(result):
        out = result.stdout
        begin = _marker(out, "begin")
        drained = _marker(out, "drained")
        ready = _marker(out, "ready")
        gate = _marker(out, "gate-passed")

        def since_begin(ms: str) -> str:
            return f"{(int(ms) - int(begin[0])) / 1000:.1f}" if begin else "?"
        if result.rc == 0 and _marker(out, "done") is not None:
            drain = (f"drained in {int(drained[0]) / 1000:.1f} s"
                     + (f" ({drained[1]} still in flight after drain_timeout)" if drained[1] != "0" else "")
                     if drained else "no front door yet: nothing to drain")
            back = _marker(out, "in-service")
            down = (f"; {roll.host} served no request while it restarted (one replica, no gateway)"
                    if roll.alone else "")
            return (f"{roll.unit} rolled: {drain}; {'new unit, ' if roll.unit_file is not None else ''}restarted, "
                    f"ready in {int(ready[0]) / 1000:.1f} s; gate passed ({gate[0] if gate else '?'}"
                    f"{' ' + ' '.join(gate[1:]) if gate and len(gate) > 1 else ''}, its checks)"
                    f"{'; out of service ' + since_begin(back[0]) + ' s' if back else ''}{down}")
        if _marker(out, "write-failed") is not None:
            raise StepFailed(f"writing {roll.unit_path} failed; {roll.unit} was not restarted and is back in service")
        failed = re.search(r"^@gate-failed (\d+) (.*)$", out, re.M)
        why = failed.group(2) if failed else f"exit {result.rc}: {(out + result.stderr).strip()[-300:]}"
        logs = _journal(out)
        if result.rc == 5:
            back = _marker(out, "rolled-back")
            took = f" {(int(back[0]) - int(failed.group(1))) / 1000:.1f} s after the failure" if back and failed else ""
            raise StepFailed(
                f"{roll.unit} failed its gate: {why}. It was rolled back to what it ran before (its unit"
                f"{', and the image it ran, retagged' if _marker(out, 'retagged') is not None else ''}) and is ready"
                f"{' and in service' if _marker(out, 'in-service') is not None else ''} again{took}. The rollout "
                f"stops here: the replicas not rolled yet were not changed. Last log lines of the failed "
                f"release:\n{logs}")
        again = " ".join(_marker(out, "rollback-failed") or ["?"])
        raise StepFailed(f"{roll.unit} failed its gate: {why}; going back to what it ran failed too ({again}). "
                         f"Last log lines:\n{logs}\nSee: invoke logs --hosts {roll.host} --replica {roll.index}; "
                         f"invoke recover --hosts {roll.host} --replica {roll.index}")
    return read
