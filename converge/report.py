"""What a run tells people and machines: a line per task per host, a recap, JSON.

Nothing secret passes through here: steps hand over masked diffs and messages.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from .progress import Transfers, escape, plain_text

STYLE = {"ok": "green", "changed": "yellow", "failed": "bold red", "skipped": "cyan",
         "unreachable": "bold red", "would change": "yellow", "interrupted": "bold yellow"}


@dataclass
class TaskResult:
    host: str
    role: str
    task: str
    status: str  # ok, changed, failed, skipped, unreachable, interrupted
    message: str = ""
    diff: str = ""
    seconds: float = 0.0


@dataclass
class HostRecap:
    ok: int = 0
    changed: int = 0
    failed: int = 0
    skipped: int = 0
    unreachable: int = 0
    interrupted: int = 0


@dataclass
class Report:
    """Collects results from every host thread and prints them as they come."""

    # a rich Console; a quiet report made without one never imports rich (a no-op run starts faster)
    console: object = None
    show_diff: bool = False
    quiet: bool = False
    tasks: list = field(default_factory=list)
    recap: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    started: float = field(default_factory=time.monotonic)
    interrupted: str | None = None  # why the run was stopped from outside (Ctrl-C, SIGTERM)
    halted: str | None = None  # why a run in batches stopped before its last batch (--max-fail)
    services: dict = field(default_factory=dict)  # what each of the run's services did (name -> figures)
    progress_every_s: float | None = None  # plain progress lines off a terminal (None: the default)
    transfers: Transfers | None = None
    # hosts whose failures are reported but do not fail the run (Ansible's ignore_errors and
    # ignore_unreachable for a whole host): the caller says which (a host off the serving path)
    advisory: frozenset = frozenset()

    def __post_init__(self):
        if self.console is None and not self.quiet:
            from rich.console import Console
            self.console = Console(stderr=False, highlight=False)
        self.transfers = Transfers(self.console, self.progress_every_s)

    def host(self, name: str):
        with self._lock:
            self.recap.setdefault(name, HostRecap())

    def add(self, result: TaskResult):
        with self._lock:
            self.tasks.append(result)
            recap = self.recap.setdefault(result.host, HostRecap())
            setattr(recap, result.status, getattr(recap, result.status) + 1)
            if self.quiet:
                return
            style = STYLE.get(result.status, "")
            took = f" ({result.seconds:.1f} s)" if result.seconds >= 0.5 else ""
            msg = f": {escape(result.message)}" if result.message else ""
            self.console.print(f"[{style}]{result.status:<11}[/{style}] [bold]{escape(result.host)}[/bold] "
                               f"{escape(result.role)} | {escape(result.task)}{msg}{took}", soft_wrap=True)
            if result.diff and (self.show_diff or result.status == "failed"):
                for line in result.diff.rstrip("\n").splitlines():
                    colour = "green" if line.startswith("+") else "red" if line.startswith("-") else "dim"
                    self.console.print(f"    [{colour}]{escape(line)}[/{colour}]", soft_wrap=True)

    def progress(self, host: str, role: str, line: str, reader=None):
        """A line of a long command's output (image pulls, downloads): read by the
        step's ``reader`` for how far it has come, else shown as it is (without
        terminal codes; "@" lines are markers for the step, not for people)."""
        text = plain_text(line).strip()
        if self.quiet or not text:
            return
        transfer = reader(text) if callable(reader) else None
        if transfer is not None:
            text = self.transfers.update(host, role, transfer)
        elif text.startswith("@"):
            return
        if text:
            self._dim(host, role, text)

    def transfer_done(self, host: str, role: str):
        """A long command ended: its progress bar goes, a last plain line comes."""
        text = self.transfers.finish(host, role)
        if text and not self.quiet:
            self._dim(host, role, text)

    def _dim(self, host: str, role: str, text: str):
        with self._lock:
            self.console.print(f"[dim]  … {escape(host)} {escape(role)} | {escape(text[:160])}[/dim]", soft_wrap=True)

    def note(self, text: str):
        if not self.quiet:
            with self._lock:
                self.console.print(text, soft_wrap=True)

    @property
    def failed(self) -> bool:
        return bool(self.interrupted) or any(r.failed or r.unreachable or r.interrupted for host, r in self.recap.items()
                                             if host not in self.advisory)

    def advisory_failures(self) -> list[str]:
        """The advisory hosts that failed or were unreachable (reported, the run not failed for them)."""
        return [host for host, r in self.recap.items() if host in self.advisory and (r.failed or r.unreachable)]

    def print_recap(self, title: str = "PLAY RECAP"):
        self.transfers.close()
        if self.quiet:
            return
        why = f", interrupted by {self.interrupted}" if self.interrupted else ""
        self.console.print(f"\n[bold]{title}[/bold] ({time.monotonic() - self.started:.1f} s{why})")
        if self.halted:
            self.console.print(f"[bold red]stopped[/bold red]: {escape(self.halted)}", soft_wrap=True)
        width = max((len(h) for h in self.recap), default=4)
        for host, r in self.recap.items():
            colour = "red" if (r.failed or r.unreachable) else "yellow" if (r.changed or r.interrupted) else "green"
            self.console.print(
                f"[{colour}]{escape(host):<{width}}[/{colour}] : ok={r.ok:<3} changed={r.changed:<3} "
                f"unreachable={r.unreachable:<3} failed={r.failed:<3} skipped={r.skipped:<3}"
                + (f" interrupted={r.interrupted}" if r.interrupted else "")
                + (" (advisory: the run does not fail for it)" if host in self.advisory and (r.failed or r.unreachable)
                   else ""))

    def as_dict(self) -> dict:
        hosts = {}
        for host, recap in self.recap.items():
            hosts[host] = {"recap": asdict(recap),
                           "tasks": [asdict(t) for t in self.tasks if t.host == host]}
            hosts[host].update(self.extra.get(host, {}))
        return {"ok": not self.failed, "seconds": round(time.monotonic() - self.started, 3), "hosts": hosts,
                "interrupted": self.interrupted, **({"halted": self.halted} if self.halted else {}),
                **({"advisory_failures": self.advisory_failures()} if self.advisory_failures() else {}),
                **self.services}


def write_json(data, target: str | None):
    """``--json FILE``; ``-`` is standard output."""
    if not target:
        return
    text = json.dumps(data, indent=2, sort_keys=False, default=str) + "\n"
    if target == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with open(target, "w", encoding="utf-8") as handle:
            handle.write(text)
