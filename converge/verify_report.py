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
    """A host x check table on a terminal; off one (a pipe, a file), a line per check and host,
    every name whole (a table there would cut them to its width)."""
    if not console.is_terminal:
        print_lines(data, console)
        console.print(summary(data), markup=False, highlight=False)
        return
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
    console.print(summary(data), markup=False, highlight=False)


def summary(data: dict) -> str:
    """``verify: 120 passed, 0 failed, 48 skipped on 7 hosts``: the last line, as pytest ends."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    for entry in data["hosts"].values():
        for c in entry["checks"]:
            key = c["status"] if c["status"] in counts else "failed"
            counts[key] += 1
    hosts = len(data["hosts"])
    return (f"verify: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped on {hosts} "
            f"host{'s' if hosts != 1 else ''}")


STATUS_WORDS = {"passed": "pass", "skipped": "skip", "failed": "FAIL"}


def print_lines(data: dict, console):
    """``VERIFY host check status [message]``, one line each, for pipes and logs."""
    width = max((len(c["check"]) for entry in data["hosts"].values() for c in entry["checks"]), default=0)
    hosts = max((len(h) for h in data["hosts"]), default=0)
    for host, entry in data["hosts"].items():
        for c in entry["checks"]:
            word = STATUS_WORDS.get(c["status"], c["status"])
            message = f" {c['message']}" if c["message"] and c["status"] != "passed" else ""
            console.print(f"{host:<{hosts}}  {c['check']:<{width}}  {word}{message}", markup=False, highlight=False,
                          soft_wrap=True)
