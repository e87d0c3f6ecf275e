"""The one readiness loop: what "a replica is ready" means, as shell every script that
starts replicas shares (the start role, a roll's gate, day 2). Ready is vLLM's own
/health answering, then /v1/models answering the key, on the replica's loopback port.
A unit that fails, goes inactive, or that systemd restarts (its container exited) fails
the wait at once, not after the timeout.

A script that uses it starts with `prelude` (``say``, ``now_ms``, and ``auth``: the key on
curl's stdin)."""
from __future__ import annotations

import re
import shlex


def prelude(env_path: str) -> str:
    """The shell every replica script starts with: ``say`` (a lost link does not stop the
    script), ``now_ms``, and vLLM's key read from the 0600 environment file into a variable
    and given to curl on its stdin (``auth | curl -K -``): never on a command line."""
    return f"""say() {{ echo "$@" 2>/dev/null; }}
now_ms() {{ echo $(( $(date +%s%N) / 1000000 )); }}
key=$(sed -n 's/^VLLM_API_KEY=//p' {shlex.quote(env_path)} 2>/dev/null)
auth() {{ printf 'header = "Authorization: Bearer %s"\\n' "$key"; }}"""

# await_ready TIMEOUT_S UNIT=PORT...: prints @replica-ready UNIT MS as each answers, then @ready MS;
# or @failed UNIT STATE MS / @timeout MS UNIT..., sets $why and $failed_unit, and returns 1
AWAIT_READY = r"""
await_ready() {
  limit=$1; shift; t0=$(now_ms); why=""; failed_unit=""; pending=""
  for e in "$@"; do pending="$pending $e=$(systemctl show -p NRestarts --value "${e%%=*}")"; done
  while :; do
    ms=$(( $(now_ms) - t0 )); left=""
    for e in $pending; do
      u=${e%%=*}; rest=${e#*=}; port=${rest%%=*}; n0=${rest#*=}
      # one systemctl for the three: each is a round trip to systemd, and this loop polls
      active=""; sub=""; n=""
      while IFS='=' read -r k v; do
        case $k in ActiveState) active=$v;; SubState) sub=$v;; NRestarts) n=$v;; esac
      done <<UNIT_STATE
$(systemctl show -p ActiveState -p SubState -p NRestarts "$u")
UNIT_STATE
      if [ "$active" = failed ] || [ "$active" = inactive ] || [ "$sub" = auto-restart ] || [ "$n" != "$n0" ]; then
        failed_unit=$u; why="its container exited after $(( ms / 1000 )) s ($active/$sub)"
        say "@failed $u $active/$sub $ms"; return 1
      fi
      if curl -fsS -o /dev/null --max-time 5 "http://127.0.0.1:$port/health" 2>/dev/null &&
         auth | curl -fsS --max-time 5 -K - -o /dev/null "http://127.0.0.1:$port/v1/models" 2>/dev/null; then
        say "@replica-ready $u $ms"
      else
        left="$left $e"
      fi
    done
    pending=$left
    if [ -z "$pending" ]; then say "@ready $(( $(now_ms) - t0 ))"; return 0; fi
    if [ $ms -ge $(( limit * 1000 )) ]; then
      why="no answer on /health and /v1/models within $limit s"
      say "@timeout $ms$(for e in $pending; do printf ' %s' "${e%%=*}"; done)"; return 1
    fi
    sleep 0.3
  done
}
"""


def entries(units: list[tuple[str, int]]) -> str:
    """``await_ready``'s arguments for ``(unit, loopback port)`` pairs (names are schema-checked)."""
    return " ".join(f"{unit}={int(port)}" for unit, port in units)


def ready_seconds(stdout: str) -> float | None:
    """The time the whole wait took, from its @ready marker."""
    found = re.search(r"^@ready (\d+)$", stdout, re.M)
    return int(found.group(1)) / 1000 if found else None


def late_units(stdout: str) -> list[str]:
    """The units still not answering when the wait timed out."""
    found = re.search(r"^@timeout \d+((?: \S+)*)$", stdout, re.M)
    return found.group(1).split() if found else []


def failed_unit(stdout: str) -> tuple[str, str] | None:
    """The unit that failed the wait, and its state."""
    found = re.search(r"^@failed (\S+) (\S+) \d+$", stdout, re.M)
    return (found.group(1), found.group(2)) if found else None
