"""Whether this host can fetch through the run's artifact relay (converge.relay):
one `curl` to it, once per host, before the first fetch. A host that cannot reach
it (behind a bastion, a firewall) fetches from upstream itself, and says so."""
from __future__ import annotations

import shlex

from converge.changes import Command


def relay_steps(ctx):
    """Yield the probe once per host when the run has a relay; afterwards
    ``ctx.desired["relay"]`` is the usable relay view or None."""
    if ctx.relay is None or "relay" in ctx.desired:
        ctx.desired.setdefault("relay", None)
        return
    url = ctx.relay.ping_url()

    def interpret(result):
        if result.rc == 0 and result.stdout.strip() == "relay":
            ctx.desired["relay"] = ctx.relay
            return f"fetching through the run's relay on the control machine ({ctx.relay.address}): each artifact " \
                   f"crosses the uplink once for all hosts of the run"
        ctx.desired["relay"] = None
        return (f"the run's relay on the control machine ({ctx.relay.address}) is not reachable from this host: "
                f"fetching from upstream itself")

    ctx.desired["relay"] = None
    yield Command("artifact relay", script=f"curl -fsS --max-time 3 {shlex.quote(url)} 2>&1\n", changes=False,
                  probe=True, timeout=30, interpret=interpret, describe="ask whether the run's relay answers")
