"""From an inventory and a set of roles to a run: resolve and validate each
host's variables, build its connection, run, report."""
from __future__ import annotations

import os
import signal
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from . import runner
from .errors import InventoryError
from .group import Connections
from .ssh_settings import SSHSettings
from .inventory import Inventory, load_inventory, parse_overrides
from .report import Report

CONNECTION_SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "connection.schema.json"


def inventory_path(given: str | None, variable: str | None = None) -> str:
    """The inventory folder: as given, else the caller's environment variable's, else ./inventory."""
    return given or (os.environ.get(variable) if variable else None) or "inventory"


@dataclass
class Play:
    inventory: Inventory
    schema: dict
    defaults: list
    overrides: dict
    # typed once at --ask-become-pass (-K), for every host that becomes without a password file
    become_password: str | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | None, var_schemas, defaults, overrides=None, path_variable: str | None = None) -> "Play":
        from . import validate  # jsonschema is slow to import; runs that skip validation never pay for it
        inventory = load_inventory(inventory_path(path, path_variable), path_variable)
        schema = validate.combine([validate.load_schema(CONNECTION_SCHEMA), *var_schemas])
        play = cls(inventory, schema, list(defaults), parse_overrides(overrides))
        return play

    def problems(self) -> list[str]:
        from . import validate
        problems = validate.check_inventory(self.inventory, self.schema, self.defaults)
        if self.overrides:
            problems += validate.check_values(self.overrides, {**self.schema, "required": []}, "--set")
        return problems

    def check(self):
        problems = self.problems()
        if problems:
            raise InventoryError(problems)

    def hostvars(self, name: str) -> dict:
        """The host's variables, with Ansible's ``group_names`` (its groups but ``all``) and
        ``direct_group_names``: the groups that list the host itself, not through a child group
        (a group's meaning may depend on whether it names the host or only contains it)."""
        host = self.inventory.host(name, self.defaults, self.overrides)
        direct = [g.name for g in self.inventory.groups.values() if name in g.hosts and g.name != "all"]
        return {**host.vars, "group_names": [g for g in host.groups if g != "all"], "direct_group_names": direct}

    def ssh_settings(self, name: str) -> SSHSettings:
        """How to reach a host (raises ConvergeError for a setting that cannot be used)."""
        return SSHSettings.from_vars(name, self.hostvars(name), self.become_password)

    def connections(self, local: bool = False) -> Connections:
        """One transport per host for a run (``local``: this machine, whatever the host)."""
        def opener(name, jumps):
            from .transport.local import LocalTransport
            if local or self.hostvars(name).get("ansible_connection") == "local":
                return LocalTransport(name).open()
            from .transport.ssh import SSHTransport
            # settings are read when the host's turn comes: a bad one fails that host alone
            return SSHTransport(self.ssh_settings(name), jumps).open()
        return Connections(opener)

    def targets(self, hosts: str | None, connections: Connections, local: bool = False) -> list[runner.Target]:
        if local:
            return [runner.Target("localhost", self._local_vars(), lambda: connections.get("localhost"))]
        return [runner.Target(name, self.hostvars(name), lambda n=name: connections.get(n))
                for name in self.inventory.select(hosts)]

    def _local_vars(self) -> dict:
        merged = {}
        for src in self.defaults:
            merged.update(src.values)
        all_group = self.inventory.groups.get("all")
        if all_group and all_group.vars:
            merged.update(all_group.vars.values)
        for src in (all_group.files if all_group else []):
            merged.update(src.values)
        merged.update(self.overrides)
        return merged


@contextmanager
def _interruptible(control: runner.RunControl, report: Report):
    """Ctrl-C: the steps in flight finish, nothing new starts; Ctrl-C again, or
    SIGTERM: abandon the steps in flight too. Either way the recap follows and the
    host locks go with the connections. (Signals reach the main thread only.)"""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_interrupt(signum, frame):
        if control.stopping.is_set():
            report.note("[yellow]interrupted again[/yellow]: abandoning the steps in flight")
            control.abandon("Ctrl-C")
        else:
            report.note("[yellow]interrupted[/yellow]: the steps in flight finish, nothing new starts "
                        "(Ctrl-C again to abandon them)")
            control.stop("Ctrl-C")

    def on_terminate(signum, frame):
        report.note("[yellow]terminated[/yellow]: abandoning the steps in flight")
        control.abandon("SIGTERM")

    old = signal.signal(signal.SIGINT, on_interrupt), signal.signal(signal.SIGTERM, on_terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])


def run(play: Play, roles, hosts=None, *, local=False, check=False, forks=10, report: Report | None = None,
        lock_name="converge", lock_wait=300, services=(), connections: Connections | None = None,
        serial: str | None = None, max_fail: str | None = None) -> Report:
    """Run ``roles`` on the hosts; ``services`` (runner.RunService) last as long as
    the run. ``connections``: the caller's, kept open after the run (verify checks
    the hosts through them); else the run's own, closed at its end."""
    report = report or Report()
    own = connections is None
    connections = connections or play.connections(local)
    control = runner.RunControl()
    try:
        with _interruptible(control, report):
            runner.run(play.targets(hosts, connections, local), roles, report, check=check, forks=forks,
                       lock_name=lock_name, lock_wait=lock_wait, control=control, services=services,
                       serial=serial, max_fail=max_fail)
    finally:
        report.transfers.close()  # no progress bar outlives the run, however it ended
        for service in services:
            figures = service.close()
            if figures is not None:  # None: it has nothing to report
                report.services[service.name] = figures
        if own:
            connections.close()
    report.interrupted = report.interrupted or control.reason
    return report
