"""Glue for `invoke top`: pick the source (Prometheus on a monitoring host when one
answers, else the hosts themselves), then refresh the view until Ctrl-C, or print one
snapshot (`--once`, `--json`)."""
from __future__ import annotations

import time

from converge.errors import ConvergeError
from converge.report import write_json

from . import top, top_view


def source_for(play, connections, hostvars: dict, choice: str):
    """``choice``: auto, prometheus or hosts. Returns (source, note: why this one)."""
    monitor = top.monitoring_host(hostvars)
    if choice in ("auto", "prometheus") and monitor:
        source = top.PrometheusSource(connections, monitor, hostvars[monitor])
        try:
            snap = source.snapshot()
            if snap.replicas or choice == "prometheus":
                return source, ""
            why = f"Prometheus on {monitor} knows no replica yet"
        except ConvergeError as exc:
            if choice == "prometheus":
                raise
            why = f"Prometheus on {monitor} is not reachable ({str(exc)[:120]})"
        return top.HostsSource(connections, hostvars), why
    if choice == "prometheus":
        raise ConvergeError("no host of the group `monitoring` in the inventory: there is no Prometheus to ask; "
                            "use --source hosts")
    return top.HostsSource(connections, hostvars), "" if choice == "hosts" else "no monitoring host in the inventory"


def keep(snap, selected: set[str]):
    """The rows and alerts of the hosts asked for (--hosts)."""
    snap.replicas = [r for r in snap.replicas if r.host in selected]
    snap.alerts = [a for a in snap.alerts if (a["host"] in selected or a["server"] in selected or not a["host"])]
    snap.gateway = {h: s for h, s in snap.gateway.items() if h in selected}
    return snap


def run(play, hosts: list[str], once: bool, json_target: str | None, every: float, choice: str) -> bool:
    from rich.console import Console
    from rich.live import Live
    hostvars = {h: play.hostvars(h) for h in play.inventory.host_names}
    selected = set(hosts)
    console = Console(stderr=json_target == "-", highlight=False)
    with play.connections() as connections:
        source, why = source_for(play, connections, hostvars, choice)
        if why:  # a note for the person, on stderr: standard output is the view (`--once | head`)
            Console(stderr=True, highlight=False).print(f"[dim]{why}: reading the hosts themselves[/dim]")
        if isinstance(source, top.HostsSource):
            source.snapshot()  # a first reading: the rates are the difference between two
            time.sleep(every)
        if once or json_target:
            snap = keep(source.snapshot(), selected)
            if json_target:
                write_json(snap.as_dict(), json_target)
            if once or json_target != "-":
                if console.is_terminal:
                    console.print(top_view.renderable(snap))
                else:
                    for line in top_view.lines(snap):
                        print(line)
            return not snap.problems
        try:
            with Live(top_view.renderable(keep(source.snapshot(), selected), every), console=console,
                      auto_refresh=False, screen=False) as live:
                while True:
                    time.sleep(every)
                    live.update(top_view.renderable(keep(source.snapshot(), selected), every), refresh=True)
        except KeyboardInterrupt:
            return True
    return True
