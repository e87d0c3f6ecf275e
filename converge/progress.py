"""How far each host's long transfers have come (image pulls, weight downloads).

On a terminal: a rich progress display, one bar per host and step, with bytes,
rate and time left. Anywhere else (CI logs, a pipe, ``--json -``): a plain line per
transfer every ``PLAIN_EVERY_S`` seconds and one when it ends, without colour codes.
"""
from __future__ import annotations

import re
import threading
import time
from dataclasses import dataclass

from .changes import Transfer


def escape(text: str) -> str:
    """rich's markup escape, imported when first needed (quiet runs never need rich)."""
    from rich.markup import escape as rich_escape
    return rich_escape(text)


PLAIN_EVERY_S = 10.0  # the caller may set another (a CI log may want fewer or more)
# CSI sequences (colours, cursor moves) and the lone OSC/charset ones tools print on a tty
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07|\x1b[()][A-Z0-9]|\r")


def plain_text(line: str) -> str:
    """A tool's output line without its terminal codes."""
    return ANSI.sub("", line)


def size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def amount(done: int, total: int | None, unit: str) -> str:
    if unit == "B":
        return f"{size(done)} of {size(total)}" if total else size(done)
    return f"{done} of {total} {unit}" if total else f"{done} {unit}"


@dataclass
class _Seen:
    started: float
    first_done: int
    last: Transfer
    printed: float = 0.0
    task: int | None = None  # rich's TaskID

    def rate(self, now: float) -> float:
        """Average since the transfer began (what was already there does not count)."""
        took = now - self.started
        return (self.last.done - self.first_done) / took if took > 0.5 else 0.0

    def line(self, now: float) -> str:
        t = self.last
        text = amount(t.done, t.total, t.unit)
        if t.total:
            text += f" ({100 * t.done / t.total:.0f}%)"
        rate = self.rate(now) if t.unit == "B" else 0  # counts of layers come too unevenly for a rate
        if rate > 0:
            text += f", {size(rate)}/s"
            if t.total and t.done < t.total:
                text += f", {max(0, (t.total - t.done) / rate):.0f} s left"
        return text


def every_from(text: str | None) -> float:
    """A period of plain progress lines as a caller's setting gives it (an
    environment variable's text, say), or the default when it is not a sane one."""
    try:
        value = float(text or "")
    except ValueError:
        return PLAIN_EVERY_S
    return value if 0 < value < 86400 else PLAIN_EVERY_S


class Transfers:
    """Per (host, step) transfers, shown as the console allows."""

    def __init__(self, console, plain_every: float | None = None):
        self.console = console  # a rich Console, or None (quiet: nothing is shown)
        self.live = console is not None and console.is_terminal
        self.plain_every = plain_every if plain_every is not None else PLAIN_EVERY_S
        self._seen: dict[tuple[str, str], _Seen] = {}
        self._lock = threading.Lock()
        self._bars = None  # a rich Progress while bars are shown

    def _progress(self):
        if self._bars is None:
            # imported at the first bar: a run without transfers (a no-op) never pays for it
            from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                       TransferSpeedColumn)
            self._bars = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                                  TransferSpeedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[note]}"),
                                  console=self.console, transient=True)
            self._bars.start()
        return self._bars

    def update(self, host: str, step: str, transfer: Transfer) -> str | None:
        """Record how far it has come; returns a plain line to print now, if one is due."""
        now = time.monotonic()
        key = (host, step)
        with self._lock:
            seen = self._seen.get(key)
            if seen is None:
                seen = self._seen[key] = _Seen(now, transfer.done, transfer, printed=now)
            seen.last = transfer
            if self.live:
                bars = self._progress()
                # bytes get rich's byte columns; counts (layers) go in the note
                total = transfer.total if transfer.unit == "B" else None
                note = "" if transfer.unit == "B" else amount(transfer.done, transfer.total, transfer.unit)
                if seen.task is None:
                    seen.task = bars.add_task(f"{escape(host)} {escape(step)}", total=total, note=note)
                bars.update(seen.task, completed=transfer.done if transfer.unit == "B" else 0, total=total,
                            note=note)
                return None
            if now - seen.printed >= self.plain_every:
                seen.printed = now
                return seen.line(now)
            return None

    def finish(self, host: str, step: str) -> str | None:
        """The step ended: drop its bar; a last plain line if anything was shown."""
        with self._lock:
            seen = self._seen.pop((host, step), None)
            if seen is None:
                return None
            if seen.printed == seen.started:  # too short to have shown anything: nothing to close
                self._drop_bar(seen)
                return None
            if self.live:
                self._drop_bar(seen)
                return None
            return seen.line(time.monotonic())

    def _drop_bar(self, seen: _Seen):
        if self._bars is not None and seen.task is not None:
            self._bars.remove_task(seen.task)
            if not self._seen:
                self._bars.stop()
                self._bars = None

    def close(self):
        with self._lock:
            if self._bars is not None:
                self._bars.stop()
                self._bars = None
            self._seen.clear()
