"""Capture a host's facts, as the roles read them, into a fact file for the plan
tests: ``python3 -m tests.plans.capture HOST [HOST...]`` (inventory from
$DGEMMA_INVENTORY) writes ``tests/plans/facts/HOST.json``. Secret files are
read as the engine reads them (hash and mode, never content)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import roles
from converge import play as playlib
from converge.changes import Role
from converge.report import Report

HERE = Path(__file__).parent


def dumps(data) -> str:
    """JSON, with a fact's sets as ``{"__set__": [...]}`` (see plans.load)."""
    return json.dumps(data, indent=1, sort_keys=True, default=lambda o: {"__set__": sorted(o)}) + "\n"


def main(hosts: list[str]) -> int:
    play = playlib.Play.load(None, roles.schemas(), roles.defaults(), path_variable=roles.INVENTORY_VARIABLE)
    every = roles.load()

    def facts(hostvars):
        wanted = {}
        for role in every:
            wanted.update(role.facts(hostvars))
        return wanted

    capture = Role("capture", facts, lambda ctx: iter(()),
                   summary=lambda ctx: {"facts": ctx.facts.values, "fact_errors": ctx.facts.errors})
    report = playlib.run(play, [capture], ",".join(hosts), check=True, report=Report(quiet=True),
                         lock_name=roles.LOCK_NAME)
    for host in hosts:
        got = report.extra.get(host)
        if not got:
            print(f"{host}: no facts ({[t.message for t in report.tasks if t.host == host]})", file=sys.stderr)
            return 1
        path = HERE / "facts" / f"{host}.json"
        path.parent.mkdir(exist_ok=True)
        path.write_text(dumps({"captured_from": host, **got}))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
