"""The `invoke status` table and JSON."""
from __future__ import annotations

from rich.table import Table

from converge.hostlock import changing_line


def status_document(report, selected: list[str] | None = None) -> dict:
    """The status of the hosts; the monitoring hosts' firing alerts (about the ``selected``
    hosts alone, when given) under "alerts", their own state under "monitoring": a monitoring
    host that does not answer is reported, the status does not fail for it."""
    hosts, monitoring, alerts = {}, {}, []
    for host, recap in report.recap.items():
        tasks = [t for t in report.tasks if t.host == host]
        unreachable = [t.message for t in tasks if t.status == "unreachable"]
        failed = [t.message for t in tasks if t.status == "failed"]
        drift = [f"{t.role}: {t.task}" for t in tasks if t.status == "changed" and not t.task.startswith("handler: ")]
        entry = {"reachable": not unreachable, "errors": unreachable + failed, "drift": drift,
                 **report.extra.get(host, {}).get("status", {})}
        entry.pop("record", None)
        extra = report.extra.get(host, {})
        if extra.get("lock_held_by"):  # a deploy (or day-2 run) is changing it: this is the host mid-run
            entry["changing"] = extra["lock_held_by"]
        if "monitoring" in extra or (host in report.advisory and "status" not in extra):
            seen = extra.get("monitoring") or {}
            monitoring[host] = {"reachable": not unreachable, "errors": unreachable + failed, "drift": drift,
                                "alertmanager_error": seen.get("error"),
                                **({"changing": entry["changing"]} if "changing" in entry else {})}
            alerts += [a for a in seen.get("alerts", []) if selected is None or a["host"] in selected
                       or a["server"] in selected]
            if "gateway_servers" not in extra:
                continue
        if "gateway_servers" in extra:  # a gateway: its servers' states, not a model
            entry["gateway_servers"] = extra["gateway_servers"]
            if extra.get("gateway_error"):
                entry["errors"].append(f"the gateway's stats page does not answer: {extra['gateway_error']}")
            if extra.get("shared_address"):
                entry["shared_address"] = extra["shared_address"]
        hosts[host] = entry
    shared = shared_address(hosts)
    ok = all(h["reachable"] and not h["errors"] for h in hosts.values()) and not (shared and shared["problem"])
    unique = list({(a["alertname"], a["host"], a["replica"], a["server"]): a for a in alerts}.values())
    return {"ok": ok, "hosts": hosts, **({"shared_address": shared} if shared else {}),
            **({"monitoring": monitoring, "alerts": unique} if monitoring else {})}


def shared_address(hosts: dict) -> dict | None:
    """Who holds the gateways' shared address: ``{"address", "holders", "problem"}``; the
    problem says what is wrong (a split: two gateways hold it; or none does)."""
    seen = {host: h["shared_address"] for host, h in hosts.items() if h.get("shared_address")}
    if not seen:
        return None
    address = next(iter(seen.values()))["address"]
    holders = [host for host, s in seen.items() if s["held"]]
    unreached = [host for host, h in hosts.items() if "gateway_servers" in h and not h["reachable"]]
    problem = None
    if len(holders) > 1:
        problem = (f"split: {' and '.join(holders)} each hold {address} (they do not hear each other's VRRP): "
                   f"clients reach one or the other at random. Check the link between them and VRRP (IP "
                   f"protocol 112) through their firewalls; `journalctl -u keepalived` on each says what it sees")
    elif not holders and not unreached:
        down = [host for host, s in seen.items() if s["keepalived"] != "active"]
        problem = (f"no gateway holds {address}: " + (f"keepalived is not running on {', '.join(down)}; run: invoke "
                                                       f"deploy --hosts {','.join(seen)}" if down else
                   "every gateway's HAProxy fails its check; see `invoke status` above and journalctl -u keepalived"))
    return {"address": address, "holders": holders, "problem": problem}


def print_status(data, console):
    """One table on a terminal; off one (a pipe, a file), a line per replica and per gateway
    server, every name whole."""
    if not console.is_terminal:
        print_lines(data, console)
        return
    table = Table("host", "unit", "container", "health", "front door", "load", "model", "diffusion",
                  "image / digest", "GPU memory", "drift", title="STATUS", title_justify="left")
    gateways = {host: h for host, h in data["hosts"].items() if "gateway_servers" in h}
    for host, h in data["hosts"].items():
        if host in gateways:
            continue
        if not h["reachable"]:
            table.add_row(host, "[red]unreachable[/red]", "", "", "", "", "", "", "", "", h["errors"][0][:80])
            continue
        image = "\n".join(filter(None, [(h.get('image') or '-').rsplit('/', 1)[-1], (h.get('digest') or '')[:19],
                                         rollback_text((h.get("replicas") or [{}])[0].get("rollback"))]))
        drift = ("[green]none[/green]" if not h["drift"] and not h["errors"] else
                 "[yellow]" + "; ".join(h["drift"] + h["errors"])[:120] + "[/yellow]")
        replicas = h.get("replicas") or [h]
        for n, r in enumerate(replicas):
            # one row per replica; the host's image and drift on its first
            label = host if len(replicas) == 1 else f"{host} #{r.get('replica', n)}"
            mem = (f"{r.get('gpu_memory_used_mib')} / {r.get('gpu_memory_total_mib')} MiB"
                   if r.get("gpu_memory_total_mib") else "unified")
            state = r.get("unit_state", "?")
            colour = "green" if state == "active/running" else "yellow"
            table.add_row(label, f"[{colour}]{state}[/{colour}]", r.get("container") or "",
                          "200" if r.get("health") == "200" else f"[red]{r.get('health')}[/red]",
                          _door(r.get("frontdoor")), load_text(r.get("load")),
                          "\n".join(filter(None, [(r.get("model") or h.get("model") or "-").split("/")[-1],
                                                   generation_text(r.get("generation"))])),
                          "\n".join(filter(None, [diffusion_text(r.get("diffusion")),
                                                   denoising_text(r.get("denoising"))])),
                          image if n == 0 else rollback_text(r.get("rollback")), mem,
                          drift if n == 0 else ("" if r.get("planned", True) else "[yellow]not planned[/yellow]"))
    if table.row_count:  # a status of the gateways alone has no replica to show
        console.print(table)
    for host, h in gateways.items():
        servers = Table("server", "pool", "state", "last check", "for", title=f"GATEWAY {host}", title_justify="left")
        for server in h["gateway_servers"]:
            colour = {"UP": "green", "DOWN": "red"}.get(server["state"].split()[0], "yellow")
            servers.add_row(server["server"], server.get("pool", ""), f"[{colour}]{server['state']}[/{colour}]",
                            server["check"], f"{server['since_s']} s" if server["since_s"] is not None else "")
        for error in h["errors"]:
            servers.add_row("[red]error[/red]", "", error[:120], "", "")
        console.print(servers)
    print_alerts(data, console)
    for line in changing_lines(data):
        console.print(f"[yellow]{line}[/yellow]", highlight=False)
    shared = data.get("shared_address")
    if shared:
        if shared["problem"]:
            console.print(f"[red]SHARED ADDRESS {shared['address']}: {shared['problem']}[/red]", highlight=False)
        else:
            console.print(f"SHARED ADDRESS {shared['address']}: held by [green]{shared['holders'][0]}[/green]"
                          if shared["holders"] else f"SHARED ADDRESS {shared['address']}: holder unknown "
                                                    f"(a gateway is unreachable)", highlight=False)


def rollback_text(rollback: dict | None, words: bool = True) -> str:
    """``back: v0.32.1-x86_64 (on disk)`` (a replica's rollback target: its image's tag, and
    whether its image and weights are still on the host); ``-`` on a line when there is none."""
    if not rollback:
        return "" if words else "-"
    tag = rollback["image"].rsplit("/", 1)[-1]
    kept = rollback["on_disk"]
    where = ("on disk" if kept["image"] and kept["weights"] else
             "image gone" if kept["weights"] else "weights gone" if kept["image"] else "gone")
    return f"back: {tag} ({where})" if words else f"{tag}:{where.replace(' ', '-')}"


def load_text(load: dict | None, words: bool = True) -> str:
    """``2 running 1 waiting kv 3%`` (vLLM's own gauges; ``running:2,waiting:1,kv:3%`` for a
    line), ``-`` when its /metrics did not answer."""
    if not load:
        return "-"
    kv = f"{load['kv_cache_usage'] * 100:.0f}%"
    if words:
        return f"{load['running']} running {load['waiting']} waiting kv {kv}"
    return f"running:{load['running']},waiting:{load['waiting']},kv:{kv}"


def alert_where(a: dict) -> str:
    return a["server"] or (a["host"] + (f"/{a['replica']}" if a["replica"] else ""))


def print_alerts(data, console):
    """The monitoring hosts' firing alerts, each with the command that fixes it."""
    if "monitoring" not in data:
        return
    for host, m in data["monitoring"].items():
        problem = (m["errors"] or [None])[0] or m["alertmanager_error"]
        if problem:
            console.print(f"[yellow]MONITORING {host}: alerts not read: {problem}[/yellow]", highlight=False)
        elif m["drift"]:
            console.print(f"[yellow]MONITORING {host}: drift: {'; '.join(m['drift'])}[/yellow]", highlight=False)
    if not data["alerts"]:
        console.print("ALERTS: [green]none firing[/green]", highlight=False)
        return
    table = Table("alert", "severity", "where", "fix", title="ALERTS (firing)", title_justify="left")
    for a in data["alerts"]:
        colour = "red" if a["severity"] == "critical" else "yellow"
        table.add_row(f"[{colour}]{a['alertname']}[/{colour}]", a["severity"], alert_where(a), a["fix"] or a["summary"])
    console.print(table)


def generation_text(settings: dict | None, sep: str = " ") -> str:
    """A replica's generation defaults in force: ``max_new_tokens none temperature 0.7``; ""
    when its command line sets none (the checkpoint's own)."""
    if not settings:
        return ""
    words = [f"{k}{sep}{'none' if v is None else v}" for k, v in settings.items()]
    return (" " if sep == " " else ",").join(words)


def diffusion_text(settings: dict | None, sep: str = " ") -> str:
    """The diffusion settings in force: ``canvas 256 steps 48 entropy_bound 0.1`` (the
    sampler's own bound, named by the sampler), or ``-`` when the replica runs none."""
    if not settings:
        return "-"
    words = []
    if "canvas_length" in settings:
        words.append(f"canvas{sep}{settings['canvas_length']}")
    if "max_denoising_steps" in settings:
        words.append(f"steps{sep}{settings['max_denoising_steps']}")
    sampler = settings.get("diffusion_sampler")
    if sampler:
        bound = settings.get("diffusion_entropy_bound") if sampler == "entropy_bound" else None
        words.append(f"{sampler}{sep}{bound}" if bound is not None else f"sampler{sep}{sampler}")
    return (" " if sep == " " else ",").join(words)


def denoising_text(seen: dict | None, sep: str = " ") -> str:
    """What the bound did since the replica started: ``steps/token 0.082 fill 0.045`` (vLLM's
    diffusion counters), empty before it committed anything or for a model that has none."""
    if not seen or seen.get("steps_per_committed_token") is None:
        return ""
    words = [f"steps/token{sep}{seen['steps_per_committed_token']:.3f}"]
    if seen.get("canvas_fill") is not None:
        words.append(f"fill{sep}{seen['canvas_fill']:.3f}")
    return (" " if sep == " " else ",").join(words)


def _door(state: str | None) -> str:
    if not state:
        return "-"
    colour = {"UP": "green", "DOWN": "red"}.get(state.split()[0], "yellow")
    return f"[{colour}]{state}[/{colour}]"


def changing_lines(data) -> list[str]:
    """A line for each host that another run was changing as status read it."""
    hosts = {**(data.get("monitoring") or {}), **data["hosts"]}
    return [changing_line(host, h["changing"], "invoke status") for host, h in hosts.items() if h.get("changing")]


def print_lines(data, console):
    """``host[#replica] unit=… container=… health=… model=… image=… gpu_memory=… drift=…`` and
    ``gateway host server state check for``, one line each."""
    def say(text):
        console.print(text, markup=False, highlight=False, soft_wrap=True)
    for host, h in data["hosts"].items():
        if "gateway_servers" in h:
            continue
        if not h["reachable"]:
            say(f"{host} unreachable: {h['errors'][0]}")
            continue
        replicas = h.get("replicas") or [h]
        drift = "; ".join(h["drift"] + h["errors"]) or "none"
        for n, r in enumerate(replicas):
            label = host if len(replicas) == 1 else f"{host}#{r.get('replica', n)}"
            mem = (f"{r.get('gpu_memory_used_mib')}/{r.get('gpu_memory_total_mib')}MiB"
                   if r.get("gpu_memory_total_mib") else "unified")
            model = (r.get("model") or h.get("model") or "-").split("/")[-1]
            planned = "" if r.get("planned", True) else " not-planned"
            say(f"{label} unit={r.get('unit_state', '?')} container={r.get('container') or '-'} "
                f"health={r.get('health') or '-'} frontdoor={(r.get('frontdoor') or '-').replace(' ', '_')} "
                f"load={load_text(r.get('load'), words=False)} model={model} "
                f"diffusion={diffusion_text(r.get('diffusion'), ':')} "
                f"{'denoising=' + denoising_text(r.get('denoising'), ':') + ' ' if r.get('denoising') else ''}"
                f"defaults={generation_text(r.get('generation'), ':') or '-'} image={(h.get('image') or '-').rsplit('/', 1)[-1]} "
                f"digest={(h.get('digest') or '-')[:19]} rollback={rollback_text(r.get('rollback'), words=False)} "
                f"gpu_memory={mem}{planned} drift={drift}")
    for host, h in data["hosts"].items():
        if "gateway_servers" not in h:
            continue
        for server in h["gateway_servers"]:
            since = f" for={server['since_s']}s" if server["since_s"] is not None else ""
            say(f"gateway {host} server={server['server']} pool={server.get('pool', '-')} "
                f"state={server['state'].replace(' ', '_')} "
                f"check={server['check'].replace(' ', '_') or '-'}{since}")
        for error in h["errors"]:
            say(f"gateway {host} error: {error}")
    for host, m in (data.get("monitoring") or {}).items():
        problem = (m["errors"] or [None])[0] or m["alertmanager_error"]
        if problem:
            say(f"monitoring {host} alerts not read: {problem}")
    for a in data.get("alerts") or []:
        say(f"alert {a['alertname']} severity={a['severity']} where={alert_where(a)} fix: {a['fix'] or a['summary']}")
    if "monitoring" in data and not data["alerts"]:
        say("alerts none firing")
    for line in changing_lines(data):
        say(line)
    shared = data.get("shared_address")
    if shared:
        holders = ",".join(shared["holders"]) or "-"
        say(f"shared_address {shared['address']} held_by={holders}" +
            (f" problem: {shared['problem']}" if shared["problem"] else ""))
