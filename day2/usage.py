"""`invoke usage` and `invoke logs --requests`: what each key used, from the gateways that
served it. Each gateway's usage service keeps its own counts per day, key (or a front end's
user) and model family (serving/accounting/files/usage_service.py); the fleet's are their sum,
and a key's tokens of a day the gateways' shared count (the highest either holds). The
records of requests are the gateways' journal. This module says what to run on a gateway
and reads what it prints; pure but for ``read``."""
from __future__ import annotations

import datetime
import json
import re
import threading
from dataclasses import dataclass, field

from converge.errors import ConvergeError
from day2.readings import PROGRAMS
from serving.accounting import RECORDS_IDENTIFIER, STATE_DIR
from serving.host_programs import Program

USAGE_DAYS_PROGRAM = Program((PROGRAMS / "usage_days.sh",))
RECORDS_PROGRAM = Program((PROGRAMS / "records.sh",))
DAY = re.compile(r"^[0-9]{4}-[0-9]{2}-[0-9]{2}$")
# what journalctl's --since takes that we pass on: a date, a time, "today", "2 hours ago"
SINCE = re.compile(r"^[0-9A-Za-z :+-]{1,40}$")
COUNTS = ("requests", "prompt_tokens", "completion_tokens", "errors", "refused", "fallbacks",
          "upstream_requests", "upstream_prompt_tokens", "upstream_completion_tokens")


class UsageError(ValueError):
    """A bad option: the message says which and what to write."""


def since_day(text: str | None, today: datetime.date) -> str:
    """``--since`` for usage: a date (YYYY-MM-DD), ``today``, or ``Nd`` (the last N days)."""
    if not text or text == "today":
        return today.isoformat()
    if DAY.match(text):
        try:
            datetime.date.fromisoformat(text)
        except ValueError as exc:
            raise UsageError(f"--since {text}: {exc}: write a date as YYYY-MM-DD") from exc
        return text
    days = re.fullmatch(r"([0-9]{1,4})d", text)
    if days:
        return (today - datetime.timedelta(days=int(days.group(1)) - 1)).isoformat()
    raise UsageError(f"--since {text!r}: write a date (2026-11-01), today, or a number of days (7d)")


def usage_command(since: str) -> str:
    """Each day file from ``since`` on, one JSON document a line."""
    assert DAY.match(since)
    return USAGE_DAYS_PROGRAM.script({"STATE_DIR": STATE_DIR, "SINCE": since})


@dataclass
class Usage:
    since: str
    # (day, key, user, model) -> counts, summed over the gateways
    rows: dict = field(default_factory=dict)
    # (day, key, user) -> tokens the gateways' shared count charged (the highest a gateway holds)
    spent: dict = field(default_factory=dict)
    problems: list = field(default_factory=list)

    def add(self, gateway: str, output: str):
        for n, line in enumerate(output.splitlines(), 1):
            if not line.strip():
                continue
            try:
                doc = json.loads(line)
                day = doc["day"]
                for subject, families in (doc.get("usage") or {}).items():
                    key, _, user = subject.partition("/")
                    for family, counts in families.items():
                        into = self.rows.setdefault((day, key, user, family), dict.fromkeys(COUNTS, 0))
                        for name in COUNTS:
                            into[name] += int(counts.get(name, 0))
                for subject, tokens in (doc.get("spent") or {}).items():
                    key, _, user = subject.partition("/")
                    self.spent[(day, key, user)] = max(self.spent.get((day, key, user), 0), int(tokens))
            except (ValueError, KeyError, TypeError, AttributeError) as exc:
                self.problems.append(f"{gateway}: {STATE_DIR}, day file {n}: unreadable ({exc}); left out")

    def only(self, key: str | None) -> "Usage":
        if not key:
            return self
        return Usage(self.since, {k: v for k, v in self.rows.items() if k[1] == key},
                     {k: v for k, v in self.spent.items() if k[1] == key}, self.problems)

    def totals(self) -> dict:
        """(key, user, model) -> counts over every day."""
        out: dict = {}
        for (_, key, user, family), counts in self.rows.items():
            into = out.setdefault((key, user, family), dict.fromkeys(COUNTS, 0))
            for name in COUNTS:
                into[name] += counts[name]
        return out

    def as_dict(self) -> dict:
        return {"since": self.since,
                "usage": [{"day": d, "key": k, "user": u or None, "model": m, **c}
                          for (d, k, u, m), c in sorted(self.rows.items())],
                "tokens_charged": [{"day": d, "key": k, "user": u or None, "tokens": n}
                                   for (d, k, u), n in sorted(self.spent.items())],
                "problems": self.problems}


def table_lines(usage: Usage) -> list[str]:
    """Per key (a front end's users under it) and model, over the days asked for."""
    head = ("key", "model", "requests", "prompt", "completion", "errors", "refused", "fallback", "upstream tok")
    rows = []
    for (key, user, family), c in sorted(usage.totals().items()):
        rows.append((f"{key}/{user}" if user else key, family, c["requests"], c["prompt_tokens"],
                     c["completion_tokens"], c["errors"], c["refused"], c["fallbacks"],
                     c["upstream_prompt_tokens"] + c["upstream_completion_tokens"]))
    if not rows:
        return [f"no request since {usage.since} (UTC)"]
    widths = [max(len(str(r[i])) for r in rows + [head]) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(x).ljust(w) if i < 2 else str(x).rjust(w)  # noqa: E731
                              for i, (x, w) in enumerate(zip(r, widths)))
    return [f"since {usage.since} (UTC), every gateway", fmt(head)] + [fmt(r) for r in rows]


def records_command(since: str | None, key: str | None, lines: int) -> str:
    """The request records of the gateway's journal (the usage service's standard output)."""
    if since is not None and not SINCE.match(since):
        raise UsageError(f"--since {since!r}: write what journalctl takes: a date and time (2026-11-26 10:00), "
                         f"today, or '2 hours ago'")
    short = re.fullmatch(r"([0-9]{1,6}) ?(s|m|min|h|d)", since or "")
    if short:  # 30m, 2h, 7d: journalctl's own relative form (-30m), which a bare 30m is not
        since = f"-{short.group(1)}{short.group(2)}"
    needle = '"key":' + json.dumps(key) + "," if key else ""
    return RECORDS_PROGRAM.script({"RECORDS_ID": RECORDS_IDENTIFIER, "SINCE": since or "", "KEY_NEEDLE": needle,
                                   "LINES": int(lines)})


def records_of(output: str, key: str | None) -> list[dict]:
    out = []
    for line in output.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        # a line with no "key" is HAProxy's access line alone (a health check, a scrape), no request's record
        if isinstance(record, dict) and "key" in record and (not key or record.get("key") == key):
            out.append(record)
    return out


def record_line(gateway: str, r: dict) -> str:
    who = f"{r.get('key')}/{r['user']}" if r.get("user") else r.get("key") or "-"
    answered = r.get("pool") or "-"
    if r.get("fallback"):
        answered += f" (fallback of {r['fallback']})"
    where = f"{r.get('host')}/{r.get('replica')}" if r.get("replica") else r.get("host") or "-"
    diffusion = r.get("diffusion") or {}
    settings = (f" canvas {diffusion.get('canvas_length')} steps<={diffusion.get('max_denoising_steps')} "
                f"{diffusion.get('diffusion_sampler')} {diffusion.get('diffusion_entropy_bound')}") if diffusion else ""
    ttft = f"{r['ttft_ms']} ms" if r.get("ttft_ms") is not None else "-"
    return (f"{r.get('time', '?')} {gateway} {who} {r.get('model') or '-'} -> {answered} {where} "
            f"{r.get('status')} tokens {r.get('prompt_tokens')}+{r.get('completion_tokens')} ttft {ttft} "
            f"{r.get('ms')} ms{settings}")


def collect(connections, scripts: dict[str, str], timeout: float = 60) -> tuple[dict[str, str], dict[str, str]]:
    """Run each host's script at once; (each host's output, what went wrong on the others)."""
    outputs: dict[str, str] = {}
    problems: dict[str, str] = {}

    def one(host):
        try:
            result = connections.get(host).run(scripts[host], timeout=timeout)
            if result.rc != 0:
                problems[host] = f"exit {result.rc}: {result.stderr.strip()[-400:]}"
            else:
                outputs[host] = result.stdout
        except ConvergeError as exc:
            problems[host] = str(exc)

    threads = [threading.Thread(target=one, args=(h,), daemon=True) for h in scripts]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outputs, problems
