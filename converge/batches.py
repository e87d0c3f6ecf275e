"""Ansible's ``serial`` and ``max_fail_percentage`` for a run: hosts in batches, one
batch after the other, and the run stops after a batch in which too many hosts
failed. Pure."""
from __future__ import annotations

import math
import re

_AMOUNT = re.compile(r"^([1-9][0-9]*)(%?)$")


class BatchError(ValueError):
    """A ``--serial`` or ``--max-fail`` that is not a count or a percentage."""


def parse(text: str, option: str, zero: bool = False) -> tuple[int, bool]:
    """``N`` or ``N%`` as (N, is_percent); ``zero``: 0 is allowed."""
    text = str(text).strip()
    if zero and text in ("0", "0%"):
        return 0, text.endswith("%")
    match = _AMOUNT.match(text)
    if not match or (match.group(2) and int(match.group(1)) > 100):
        raise BatchError(f"{option} {text}: expected a count of hosts (1, 2, ...) or a percentage (1% to 100%)"
                         + (", or 0" if zero else ""))
    return int(match.group(1)), bool(match.group(2))


def batches(items: list, serial: str | None) -> list[list]:
    """``items`` cut into batches of ``serial`` hosts (N, or N% of them, rounded down but at
    least 1); None: one batch of all."""
    if not serial or not items:
        return [list(items)] if items else []
    amount, percent = parse(serial, "--serial")
    size = max(1, math.floor(len(items) * amount / 100)) if percent else amount
    return [list(items[i:i + size]) for i in range(0, len(items), size)]


def too_many_failed(failed: int, batch: int, max_fail: str | None) -> bool:
    """Whether a batch with ``failed`` of ``batch`` hosts failed stops the run: more than
    ``max_fail`` hosts (or percent of the batch), as Ansible's max_fail_percentage; None: any."""
    if not failed:
        return False
    if max_fail is None:
        return True
    amount, percent = parse(max_fail, "--max-fail", zero=True)
    return failed * 100 > amount * batch if percent else failed > amount
