"""What every benchmark script does first and last: go on under the toolkit's own
environment, and put its table into docs/PERFORMANCE.md between its markers."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def in_toolkit_env():
    """Go on under the toolkit's own environment (./run.sh makes .venv) when started
    with a python3 that lacks its dependencies; say how to make it when there is none."""
    import importlib.util
    if importlib.util.find_spec("invoke") and importlib.util.find_spec("fabric"):
        return
    python = ROOT / ".venv" / "bin" / "python"
    if not python.exists():
        raise SystemExit("the toolkit's environment is missing: run ./run.sh main (or ./run.sh test) once first")
    os.execv(python, [str(python), *sys.argv])


def cpu_times() -> tuple[int, int]:
    """(idle, total) jiffies of the whole machine since boot, from /proc/stat: two readings
    around a load give the machine's idle share during it."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return fields[3] + fields[4], sum(fields[:8])


def haproxy_program() -> str | None:
    """The HAProxy the benchmarks run: $DGEMMA_HAPROXY when set, else the 3.0 LTS the tests
    and the lab's image run (`invoke lab.haproxy` unpacks it in the lab's cache, lab/config.py's
    CACHE; stdlib only, so lab/ is not imported), else the one on PATH."""
    if os.environ.get("DGEMMA_HAPROXY"):
        return os.environ["DGEMMA_HAPROXY"]
    cache = Path(os.environ.get("DGEMMA_LAB_CACHE", "/var/cache/dgemma-lab"))
    unpacked = cache / "haproxy-3.0" / os.uname().machine / "haproxy"
    if unpacked.exists():
        return str(unpacked)
    import shutil
    return shutil.which("haproxy")


# HAProxy's httplog timers, TR/Tw/Tc/Tr/Ta, then the status ("+" before Ta: logged before the end)
HAPROXY_TIMERS = re.compile(r" (-?\d+)/(-?\d+)/(-?\d+)/(-?\d+)/(\+?-?\d+) \d{3} ")


def haproxy_timers(lines, path: str = "/v1/chat/completions") -> list[tuple[int, int]]:
    """``(Tr, Ta)`` in whole ms for each request to ``path`` in an HAProxy access log (httplog)
    that a server answered: Tr is the wait for the server's answer, ``Ta - Tr`` HAProxy's own
    time (receiving the request, queueing, connecting, sending the answer). A line logged
    twice (units written before the passthrough log driver logged each line twice) counts once."""
    out = []
    for line in dict.fromkeys(lines):
        if f" {path} " not in line:
            continue
        found = HAPROXY_TIMERS.search(line)
        if found:
            tr, ta = int(found.group(4)), int(found.group(5).lstrip("+"))
            if tr >= 0 and ta >= 0:
                out.append((tr, ta))
    return out


def percentile(values, q: float) -> float:
    """The ``q`` quantile of ``values``, interpolated between the two nearest; NaN when there are none."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def write_section(begin: str, end: str, section: str, doc: Path = ROOT / "docs" / "PERFORMANCE.md"):
    """``section`` (which starts with ``begin`` and ends with ``end``) in place of the one
    the document has between those markers, or at its end."""
    text = doc.read_text()
    if begin in text:
        start, stop = text.index(begin), text.index(end) + len(end)
        text = text[:start] + section + text[stop:]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    doc.write_text(text)
