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
from .connection import LocalConnection, SSHConnection
from .errors import InventoryError
from .fabric_ssh import JumpHosts
from .relay import Relay
from .ssh_settings import SSHSettings
from .inventory import Inventory, load_inventory, parse_overrides
from .report import Report

CONNECTION_SCHEMA = Path(__file__).resolve().parent.parent / "schemas" / "connection.schema.json"


def inventory_path(given: str | None) -> str:
    return given or os.environ.get("DGEMMA_INVENTORY") or "inventory"


@dataclass
class Play:
    inventory: Inventory
    schema: dict
    defaults: list
    overrides: dict
    # typed once at --ask-become-pass (-K), for every host that becomes without a password file
    become_password: str | None = field(default=None, repr=False)

    @classmethod
    def load(cls, path: str | None, var_schemas, defaults, overrides=None) -> "Play":
        from . import validate  # jsonschema is slow to import; runs that skip validation never pay for it
        inventory = load_inventory(inventory_path(path))
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
        return self.inventory.host(name, self.defaults, self.overrides).vars

    def ssh_settings(self, name: str) -> SSHSettings:
        """How to reach a host (raises ConvergeError for a setting that cannot be used)."""
        return SSHSettings.from_vars(name, self.hostvars(name), self.become_password)

    def targets(self, hosts: str | None, local: bool = False, jumps: JumpHosts | None = None) -> list[runner.Target]:
        """The hosts to run on; SSH hosts reach their jump hosts through ``jumps``
        (one connection per jump host per run)."""
        if local:
            return [runner.Target("localhost", self._local_vars(),
                                  lambda: LocalConnection("localhost").open())]
        out = []
        for name in self.inventory.select(hosts):
            hv = self.hostvars(name)
            if hv.get("ansible_connection") == "local":
                out.append(runner.Target(name, hv, lambda n=name: LocalConnection(n).open()))
            else:
                # settings are read when the host's turn comes: a bad one fails that host alone
                out.append(runner.Target(name, hv, lambda n=name: SSHConnection(self.ssh_settings(n), jumps).open()))
        return out

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
        lock_name="dgemma", lock_wait=300) -> Report:
    report = report or Report()
    jumps = JumpHosts()
    control = runner.RunControl()
    relay = Relay()  # serves only if a role asks for it; gone, files and all, at the end
    try:
        with _interruptible(control, report):
            runner.run(play.targets(hosts, local, jumps), roles, report, check=check, forks=forks,
                       lock_name=lock_name, lock_wait=lock_wait, control=control, relay=relay)
    finally:
        report.transfers.close()  # no progress bar outlives the run, however it ended
        relay.close()
        jumps.close()
    report.relay = dict(relay.stats)
    report.interrupted = report.interrupted or control.reason
    return report
