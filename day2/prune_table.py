"""What `invoke prune` shows and writes to --json: per host, what goes (or would go, --check),
each with its size and what it frees, what stays and why, and the totals."""
from __future__ import annotations

from serving.prune import size_text


def prune_document(report, check: bool) -> dict:
    """The run's report (each step, the recap) with each host's selection: under "prune", what was
    to go; "removed" (a real run) what did, and "freed" what that freed."""
    data = report.as_dict()
    data["check"] = check
    for host, h in data["hosts"].items():
        chosen = h.get("prune")
        if not chosen or "remove" not in chosen:
            continue
        done = {t["task"] for t in h["tasks"] if t["status"] == "changed"}
        if not check:
            went = [r for r in chosen["remove"] if f"remove {r['kind']} {r['what']}" in done]
            chosen["removed"] = went
            chosen["freed"] = sum(r["frees"] for r in went)
    return data


def print_prune(data: dict, console) -> None:
    check = data["check"]
    for host, h in data["hosts"].items():
        chosen = h.get("prune")
        if not chosen:
            continue
        if "error" in chosen:
            console.print(f"{host}: {chosen['error']}", markup=False, highlight=False, soft_wrap=True)
            continue
        listed = chosen["remove"] if check else chosen.get("removed", [])
        for r in listed:
            console.print(f"{host}: {'would remove' if check else 'removed'} {r['kind']} {r['what']}: "
                          f"{size_text(r['size'])}, frees {size_text(r['frees'])}", markup=False, highlight=False, soft_wrap=True)
        for kept in chosen["kept"]:
            console.print(f"{host}: keeps {kept['what']} ({kept['why']})", markup=False, highlight=False, soft_wrap=True)
        total = chosen["frees"] if check else chosen.get("freed", 0)
        console.print(f"{host}: {'would free' if check else 'freed'} {size_text(total)}"
                      f"{'' if listed else ' (nothing to remove)'}", markup=False, highlight=False, soft_wrap=True)
