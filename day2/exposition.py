"""Prometheus's text format read back, and what Prometheus computes from it, for the
commands that read exporters without a Prometheus (`invoke top` straight from the front
doors, `invoke status`): samples, counters' rates between two readings, and
``histogram_quantile`` as Prometheus computes it. Pure."""
from __future__ import annotations

import math
import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse(text: str) -> list[tuple[str, dict, float]]:
    """Every sample: (name, labels, value); comments and lines it cannot read are left out."""
    out = []
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if not match or line.startswith("#"):
            continue
        labels = {k: v.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for k, v in _LABEL.findall(match.group(3) or "")}
        try:
            value = float(match.group(4))
        except ValueError:
            continue
        out.append((match.group(1), labels, value))
    return out


def value(samples, name: str, **labels) -> float | None:
    """The sum of the samples named ``name`` whose labels include ``labels`` (None: none)."""
    found = [v for n, l, v in samples if n == name and all(l.get(k) == want for k, want in labels.items())]
    return sum(found) if found else None


def buckets(samples, name: str, **labels) -> list[tuple[float, float]]:
    """A histogram's cumulative buckets (upper bound, count), summed over the other labels."""
    by_bound: dict[float, float] = {}
    for n, l, v in samples:
        if n == f"{name}_bucket" and all(l.get(k) == want for k, want in labels.items()) and "le" in l:
            bound = math.inf if l["le"] in ("+Inf", "Inf") else float(l["le"])
            by_bound[bound] = by_bound.get(bound, 0.0) + v
    return sorted(by_bound.items())


def delta(now: list[tuple[float, float]], before: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The buckets' increase between two readings (a counter reset: the new reading)."""
    old = dict(before)
    pairs = [(b, c - old.get(b, 0.0)) for b, c in now]
    return now if any(c < 0 for _, c in pairs) else pairs


def histogram_quantile(q: float, cumulative: list[tuple[float, float]]) -> float | None:
    """Prometheus's histogram_quantile over cumulative buckets: linear within the bucket the
    rank falls in; the highest finite bound when it falls in +Inf; None without observations."""
    if not cumulative or cumulative[-1][0] != math.inf:
        return None
    total = cumulative[-1][1]
    if total <= 0:
        return None
    rank = q * total
    previous_bound, previous_count = 0.0, 0.0
    for bound, count in cumulative:
        if count >= rank:
            if bound == math.inf:
                return previous_bound
            if count == previous_count:
                return bound
            return previous_bound + (bound - previous_bound) * (rank - previous_count) / (count - previous_count)
        previous_bound, previous_count = bound, count
    return previous_bound
