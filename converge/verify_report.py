"""The verify report: a host x check table, and its JSON."""
from __future__ import annotations

from rich.table import Table


def verify_document(results, unreachable: dict, expected: dict) -> dict:
    hosts: dict = {}
    for host, message in unreachable.items():
        hosts[host] = {"ok": False, "checks": [{"check": "ssh", "status": "failed", "message": message}]}
    for r in results:
        entry = hosts.setdefault(r.host, {"ok": True, "checks": []})
        entry["checks"].append({"check": r.check, "status": r.status, "message": r.message})
        if r.status == "failed":
            entry["ok"] = False
    return {"ok": all(h["ok"] for h in hosts.values()) and bool(hosts), "hosts": hosts}


def print_table(data: dict, console):
    checks = []
    for entry in data["hosts"].values():
        for c in entry["checks"]:
            if c["check"] not in checks:
                checks.append(c["check"])
    table = Table("check", *data["hosts"].keys(), title="VERIFY", title_justify="left")
    for check in checks:
        row = [check]
        for entry in data["hosts"].values():
            found = next((c for c in entry["checks"] if c["check"] == check), None)
            if found is None:
                row.append("")
            elif found["status"] == "passed":
                row.append("[green]pass[/green]")
            elif found["status"] == "skipped":
                row.append(f"[cyan]skip[/cyan] {found['message']}")
            else:
                row.append(f"[red]FAIL[/red] {found['message']}")
        table.add_row(*row)
    console.print(table)
