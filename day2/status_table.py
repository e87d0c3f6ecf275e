"""The `invoke status` table and JSON."""
from __future__ import annotations

from rich.table import Table


def status_document(report) -> dict:
    hosts = {}
    for host, recap in report.recap.items():
        tasks = [t for t in report.tasks if t.host == host]
        unreachable = [t.message for t in tasks if t.status == "unreachable"]
        failed = [t.message for t in tasks if t.status == "failed"]
        drift = [f"{t.role}: {t.task}" for t in tasks if t.status == "changed" and not t.task.startswith("handler: ")]
        entry = {"reachable": not unreachable, "errors": unreachable + failed, "drift": drift,
                 **report.extra.get(host, {}).get("status", {})}
        entry.pop("record", None)
        hosts[host] = entry
    ok = all(h["reachable"] and not h["errors"] for h in hosts.values())
    return {"ok": ok, "hosts": hosts}


def print_status(data, console):
    table = Table("host", "unit", "container", "health", "model", "image / digest", "GPU memory", "drift",
                  title="STATUS", title_justify="left")
    for host, h in data["hosts"].items():
        if not h["reachable"]:
            table.add_row(host, "[red]unreachable[/red]", "", "", "", "", "", h["errors"][0][:80])
            continue
        mem = (f"{h.get('gpu_memory_used_mib')} / {h.get('gpu_memory_total_mib')} MiB"
               if h.get("gpu_memory_total_mib") is not None else "unified")
        image = f"{(h.get('image') or '-').rsplit('/', 1)[-1]}\n{(h.get('digest') or '')[:19]}"
        state = h.get("unit_state", "?")
        colour = "green" if state == "active/running" else "yellow"
        table.add_row(host, f"[{colour}]{state}[/{colour}]", h.get("container") or "",
                      "200" if h.get("health") == "200" else f"[red]{h.get('health')}[/red]",
                      (h.get("model") or "-").split("/")[-1], image, mem,
                      "[green]none[/green]" if not h["drift"] and not h["errors"] else
                      "[yellow]" + "; ".join(h["drift"] + h["errors"])[:120] + "[/yellow]")
    console.print(table)
