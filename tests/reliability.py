"""What the fault suite and the fuzz test measure, written into docs/RELIABILITY.md
(and docs/reliability.json) at the end of a test session: by the suite, never by
hand. A session that runs only some of the tests updates only their rows."""
from __future__ import annotations

import fcntl
import json
import os
import platform
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JSON = ROOT / "docs" / "reliability.json"
DOC = ROOT / "docs" / "RELIABILITY.md"
RECORDS: dict[str, dict] = {}


def record(key: str, kind: str, what: str, injected: str, detected_s: float | None, saw: str, left: str,
           nothing_lost: bool, **extra):
    """One row: a fault (or a class of bad input), how it was made, how long until the
    user was told, what they saw, what the host was left with."""
    RECORDS[key] = {"kind": kind, "what": what, "injected": injected,
                    "detected_s": None if detected_s is None else round(detected_s, 1),
                    "saw": " ".join(saw.split())[:400], "left": left, "nothing_lost": nothing_lost,
                    "measured": time.strftime("%Y-%m-%d"), **extra}


def write():
    if not RECORDS:
        return
    # pytest-xdist's workers each write what they measured: one at a time, each over the last
    lock = Path(tempfile.gettempdir()) / "dgemma-reliability.lock"
    with open(lock, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        _merge()


def _merge():
    try:
        data = json.loads(JSON.read_text())
    except (OSError, ValueError):
        data = {"rows": {}}
    data["rows"].update(RECORDS)
    data["machine"] = f"{platform.node()} ({os.cpu_count()} cores)"
    JSON.parent.mkdir(parents=True, exist_ok=True)
    JSON.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    rows = data["rows"]
    lines = ["# Reliability: faults and bad input", "",
             "Written by the test suite (`tests/reliability.py`), not by hand: each row is what the last run of "
             "its test measured (`./run.sh test`; the fault rows need the lab, as root). Faults are injected for "
             "real on the lab's hosts: links taken down, hosts killed, disks filled, services stopped, signals "
             "sent. \"Detected\" is the time from the fault to the host's failure in the report; \"nothing lost\" "
             "means no half-written file, no temporary file, no held lock, and a deploy run afterwards converged.",
             ""]
    for kind, title in (("input", "Bad input"), ("fault", "Faults on the lab")):
        chosen = sorted((k, v) for k, v in rows.items() if v["kind"] == kind)
        if not chosen:
            continue
        lines += [f"## {title}", "", "| what | how it was made | detected | what the user saw | what was left | "
                  "nothing lost | measured |", "|---|---|---|---|---|---|---|"]
        for _, row in chosen:
            detected = "-" if row["detected_s"] is None else f"{row['detected_s']} s"
            saw = row["saw"].replace("|", "\\|")
            lines.append(f"| {row['what']} | {row['injected']} | {detected} | {saw} | {row['left']} | "
                         f"{'yes' if row['nothing_lost'] else '**no**'} | {row['measured']} |")
        lines.append("")
    lines.append(f"Last written on {data['machine']}.")
    DOC.write_text("\n".join(lines) + "\n")
