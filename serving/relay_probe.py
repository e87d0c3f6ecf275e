"""Whether this host can fetch through the run's artifact relay: one `curl` to
it, once per host, before the first fetch. A host that cannot reach it (behind a
bastion, a firewall) fetches from upstream itself, and says so."""
from __future__ import annotations

from pathlib import Path

from converge.changes import Command, Output, Produced
from relay.server import RelayView

from .host_programs import Program

RELAY = Output("the run's artifact relay", RelayView)
PING_PROGRAM = Program((Path(__file__).parent / "files" / "relay_ping.sh",))


def relay_steps(ctx):
    """The probe, once per host, when the run offers a relay; it produces RELAY:
    the relay as this host reaches it, or None. Read it with ``usable_relay``. A check
    starts no relay (it would serve nothing, and make its folder on the control machine)."""
    offered = ctx.services.get("relay")
    if offered is None or RELAY in ctx.results or ctx.check:
        return

    def interpret(result):
        if result.rc == 0 and result.stdout.strip() == "relay":
            return Produced(offered, f"fetching through the run's relay on the control machine "
                                     f"({offered.address}): each artifact crosses the uplink once for all hosts "
                                     f"of the run")
        return Produced(None, f"the run's relay on the control machine ({offered.address}) is not reachable from "
                              f"this host: fetching from upstream itself")

    yield Command("artifact relay", script=PING_PROGRAM.script({"URL": offered.ping_url()}),
                  changes=False, probe=True, timeout=30, interpret=interpret, produces=RELAY,
                  describe="ask whether the run's relay answers")


def usable_relay(ctx) -> RelayView | None:
    return ctx.results.get(RELAY)


def fallback_note(output: str) -> str:
    """What a pull script printed when the relay failed it and it fetched from the
    registry itself ('@relay-failed' after the relay's error lines), as words for
    the report; '' when the relay served it."""
    lines = output.splitlines()
    if not any(line.startswith("@relay-failed") for line in lines):
        return ""
    at = next(i for i, line in enumerate(lines) if line.startswith("@relay-failed"))
    why = next((line.strip() for line in reversed(lines[:at]) if line.strip()), "no reason given")
    return f"; the run's relay failed it ({why[:200]}): pulled from the registry itself"
