"""What `invoke top` shows: a table that fits 80 columns (a replica a row), the hosts'
state in the gateways, and the firing alerts with the command that fixes each. Pure
functions of a Snapshot: rich renderables for the live view, lines for --once off a
terminal."""
from __future__ import annotations

import time

from rich.console import Group
from rich.table import Table
from rich.text import Text

MODEL_SHORT = {"diffusiongemma": "dgemma"}
# STP/T: a diffusion model's denoising steps per committed token (what its entropy bound does:
# fewer at a higher bound); its canvas fill is in --json
COLUMNS = [("HOST/REP", 9, "left"), ("MODEL", 6, "left"), ("GW", 5, "left"), ("RUN", 3, "right"),
           ("WAIT", 4, "right"), ("TOK/S", 5, "right"), ("TTFT50", 6, "right"), ("TTFT95", 6, "right"),
           ("KV%", 3, "right"), ("GPU%", 4, "right"), ("MEM GiB", 7, "right"), ("ERR/S", 5, "right"),
           ("STP/T", 5, "right")]
WIDTH = 80


def _num(value, digits=0, scale=1.0) -> str:
    if value is None:
        return "-"
    return f"{value * scale:.{digits}f}"


def _seconds(value) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def _memory(row) -> str:
    if row.gpu_memory_used_mib is None:
        return "-"
    used = row.gpu_memory_used_mib / 1024
    total = row.gpu_memory_total_mib / 1024 if row.gpu_memory_total_mib else None
    return f"{used:.0f}/{total:.0f}" if total else f"{used:.0f}"


def cells(snap, row) -> list[str]:
    state = "down" if row.up is False else snap.gateway.get(row.host, "-")
    return [f"{row.host}/{row.replica}"[:9], MODEL_SHORT.get(row.model, row.model)[:6], state[:5],
            _num(row.running), _num(row.waiting), _num(row.tokens_s), _seconds(row.ttft_p50_s),
            _seconds(row.ttft_p95_s), _num(row.kv_cache, 0, 100), _num(row.gpu_util), _memory(row),
            _num(row.errors_s, 2), _num(row.steps_per_token, 3)]


def header(snap, every: float | None) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(snap.at))
    refresh = f", every {every:g} s, Ctrl-C quits" if every else ""
    return f"dgemma top · {snap.source} · {when}{refresh}"[:WIDTH]


def alert_lines(snap) -> list[str]:
    if not snap.alerts_known:
        return ["alerts: not evaluated (read from the hosts: no Prometheus asked)"]
    if not snap.alerts:
        return ["no alert firing"]
    out = []
    for a in sorted(snap.alerts, key=lambda a: (a["severity"] != "critical", a["alertname"], a["host"])):
        where = a["server"] or a["host"] + (f"/{a['replica']}" if a["replica"] else "")
        out.append(f"FIRING {a['alertname']} {where}: {a['fix'] or a['summary']}"[:WIDTH])
    return out


def key_lines(snap) -> list[str]:
    """The busiest keys through the gateways: requests and tokens a second, tokens of today."""
    if not snap.keys:
        return []
    out = [f"{'KEY (busiest)':<34} {'REQ/S':>7} {'TOK/S':>8} {'TOKENS TODAY':>14}"]
    for k in snap.keys:
        who = f"{k.key}/{k.user}" if k.user else k.key
        out.append(f"{who[:34]:<34} {_num(k.requests_s, 2):>7} {_num(k.tokens_s, 0):>8} {_num(k.tokens_today):>14}")
    return out


def renderable(snap, every: float | None = None):
    # one space after each column, none before: the columns' widths and their gaps make 80
    # (padding on both sides made 91, and rich cropped every column to fit: "RU", "dgemm")
    table = Table(box=None, pad_edge=False, padding=(0, 1, 0, 0), show_edge=False, header_style="bold")
    for name, width, justify in COLUMNS:
        table.add_column(name, width=width, justify=justify, no_wrap=True, overflow="crop")
    for row in snap.replicas:
        style = "red" if row.up is False else "yellow" if (row.waiting or 0) > 0 else ""
        table.add_row(*cells(snap, row), style=style)
    parts = [Text(header(snap, every), style="bold"), table]
    for i, line in enumerate(key_lines(snap)):
        parts.append(Text(line, style="bold" if i == 0 else ""))
    for line in alert_lines(snap):
        parts.append(Text(line, style="red" if line.startswith("FIRING") else "dim"))
    for problem in snap.problems:
        parts.append(Text(f"! {problem}"[:WIDTH], style="yellow"))
    return Group(*parts)


def lines(snap) -> list[str]:
    """The same, as plain lines of at most 80 characters (a pipe, a file)."""
    out = [header(snap, None), " ".join(f"{n:<{w}}" if j == "left" else f"{n:>{w}}" for n, w, j in COLUMNS)]
    for row in snap.replicas:
        out.append(" ".join(f"{c:<{w}}" if j == "left" else f"{c:>{w}}"
                            for c, (_, w, j) in zip(cells(snap, row), COLUMNS)))
    out += key_lines(snap) + alert_lines(snap) + [f"! {p}"[:WIDTH] for p in snap.problems]
    return out
