"""Day-2 tasks: status, start, stop, restart, recover, logs, endpoints, bench, top, usage, tune, prune."""
from __future__ import annotations

import sys

from invoke import Collection, Exit, task

from converge.errors import ConvergeError

from . import runs


def _ops(inventory, hosts, role, set=None, json_target=None, title="RECAP", ask_become_pass=False, serial=None,
         max_fail=None):
    """Run one day-2 role on hosts through the engine (connection, lock, report)."""
    runs.check_batches(serial, max_fail)
    play = runs.load_play(inventory, set, ask_become_pass)
    report = runs.run(play, [role], hosts, json_target, title=title, serial=serial, max_fail=max_fail)
    runs.finish(report, report.as_dict(), json_target)


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"], "json": runs.HELP["json"],
                            "ask_become_pass": runs.HELP["ask_become_pass"]})
def status(c, inventory=None, hosts=None, json=None, ask_become_pass=False):
    """One table for the fleet: unit, container, health, model, image, GPU memory, drift."""
    import roles
    from day2.status import gateway_status_role, monitoring_status_role, status_role
    from day2.status_table import print_status, status_document
    from serving.fleet import is_monitoring
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    selected = runs.select(play, hosts)
    # the monitoring hosts too, whichever hosts are asked for: the alerts that fire are theirs
    monitors = [h for h in play.inventory.host_names if is_monitoring(play.hostvars(h)) and h not in selected]
    report = runs.run(play, roles.load() + [status_role(), gateway_status_role(), monitoring_status_role()],
                      ",".join(selected + monitors), json, check=True)
    data = status_document(report, selected if hosts else None)
    print_status(data, report.console)
    runs.finish(report, data, json, ok=data["ok"])


OPS_HELP = {"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"], "json": runs.HELP["json"],
            "set": runs.HELP["set"], "ask_become_pass": runs.HELP["ask_become_pass"], **runs.SERIAL_HELP,
            "replica": "act on this replica alone (its index, as invoke status shows it; default: all of them)"}
NOW_HELP = ("every replica of each host at once, with no fleet-wide limit (still drained and gated): for an "
            "emergency; by default one replica of the fleet at a time behind a gateway, as deploy rolls")


def _replica(value) -> int | None:
    """``--replica N``: a replica's index, or None for all of them."""
    if value is None:
        return None
    if not str(value).isdigit():
        raise Exit(f"--replica {value}: expected a replica's index (0, 1, ...; invoke status shows them)", code=2)
    return int(value)


@task(klass=runs.HostTask, help=OPS_HELP, iterable=["set"])
def start(c, inventory=None, hosts=None, json=None, set=None, ask_become_pass=False, replica=None, serial=None,
          max_fail=None):
    """Start vLLM's replicas (stopping the units they conflict with, e.g. ollama), each through its gate."""
    from day2.lifecycle import start_role
    _ops(inventory, hosts, start_role(replica=_replica(replica)), set, json, ask_become_pass=ask_become_pass,
         serial=serial, max_fail=max_fail)


@task(klass=runs.HostTask, help={**OPS_HELP, "now": NOW_HELP,
                                 "resume": "start again the units vLLM conflicts with (e.g. ollama)"},
      iterable=["set"])
def stop(c, inventory=None, hosts=None, resume=False, json=None, set=None, ask_become_pass=False, replica=None,
         serial=None, max_fail=None, now=False):
    """Stop vLLM's replicas, each drained first; with --resume, start the units they displaced."""
    from day2.lifecycle import stop_role
    _ops(inventory, hosts, stop_role(resume, _replica(replica), now=now), set, json, ask_become_pass=ask_become_pass,
         serial=serial, max_fail=max_fail)


@task(klass=runs.HostTask, help={**OPS_HELP, "now": NOW_HELP}, iterable=["set"])
def restart(c, inventory=None, hosts=None, json=None, set=None, ask_become_pass=False, replica=None, serial=None,
            max_fail=None, now=False):
    """Restart vLLM's replicas as deploy rolls them: drained, restarted, gated, back in service."""
    from day2.lifecycle import restart_role
    _ops(inventory, hosts, restart_role(replica=_replica(replica), now=now), set, json,
         ask_become_pass=ask_become_pass, serial=serial, max_fail=max_fail)


@task(klass=runs.HostTask, help={**OPS_HELP, "now": NOW_HELP}, iterable=["set"])
def recover(c, inventory=None, hosts=None, json=None, set=None, ask_become_pass=False, replica=None, serial=None,
            max_fail=None, now=False):
    """Clear a crash loop or a wedged container; refuse (reboot needed) if nvidia-smi hangs."""
    from day2.lifecycle import recover_role
    _ops(inventory, hosts, recover_role(_replica(replica), now=now), set, json, title="RECOVER RECAP",
         ask_become_pass=ask_become_pass, serial=serial, max_fail=max_fail)


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"],
                            "lines": "lines of history (default 50)",
                            "follow": "keep printing new lines (Ctrl-C to stop)",
                            "replica": OPS_HELP["replica"],
                            "requests": "the gateways' record of each request instead (key, model, status, tokens, "
                                        "time to first token, the replica's diffusion settings)",
                            "key": "with --requests: one key's requests alone",
                            "since": "with --requests: from then on, as journalctl takes it (2026-11-26 10:00, "
                                     "today, '2 hours ago', 30m, 2h)",
                            "json": "with --requests: the records as JSON to FILE ('-' for standard output)",
                            "ask_become_pass": runs.HELP["ask_become_pass"]})
def logs(c, inventory=None, hosts=None, lines=50, follow=False, ask_become_pass=False, replica=None, requests=False,
         key=None, since=None, json=None):
    """The journal of vLLM's replicas on each host, prefixed by host; --requests: the gateways' request records."""
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    if requests:
        _request_records(play, hosts, int(lines), key, since, json)
        return
    if key or since or json:
        raise Exit("--key, --since and --json go with --requests (the gateways' request records)", code=2)
    from day2.logs import stream_logs
    failed = stream_logs(play, runs.select(play, hosts), int(lines), follow, replica=_replica(replica))
    if failed:
        raise Exit(code=1)


def _gateways(play, hosts) -> list[str]:
    from serving.fleet import is_gateway
    gateways = [h for h in runs.select(play, hosts) if is_gateway(play.hostvars(h))]
    if not gateways:
        raise Exit("no gateway among the hosts: usage and request records are the gateways' (inventory group "
                   "`gateway`)", code=2)
    return gateways


def _request_records(play, hosts, lines: int, key, since, json_target):
    from converge.report import write_json
    from day2.usage import UsageError, collect, record_line, records_command, records_of
    runs.writable(json_target)
    gateways = _gateways(play, hosts)
    try:
        command = records_command(since, key, lines)
    except UsageError as exc:
        raise Exit(str(exc), code=2)
    with play.connections() as connections:
        outputs, problems = collect(connections, {g: command for g in gateways})
    records = sorted(((r.get("t", 0), g, r) for g, out in outputs.items() for r in records_of(out, key)),
                     key=lambda item: item[0])
    if json_target:
        write_json({"records": [{"gateway": g, **r} for _, g, r in records], "problems": problems}, json_target)
    else:
        for _, gateway, record in records:
            print(record_line(gateway, record))
    for host, problem in sorted(problems.items()):
        print(f"{host}: the records could not be read: {problem}", file=sys.stderr)
    if problems:
        raise Exit(code=1)


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"],
                                 "since": "from this day on (UTC): a date (2026-11-01), today (the default) or "
                                          "a number of days (7d)",
                                 "key": "one key alone (a front end's users under it)",
                                 "json": runs.HELP["json"],
                                 "ask_become_pass": runs.HELP["ask_become_pass"]})
def usage(c, inventory=None, hosts=None, since=None, key=None, json=None, ask_become_pass=False):
    """Requests and tokens per key and model, summed over the gateways."""
    import datetime

    from converge.report import write_json
    from day2.usage import Usage, UsageError, collect, since_day, table_lines, usage_command
    runs.writable(json)
    try:
        first = since_day(since, datetime.datetime.now(datetime.timezone.utc).date())
    except UsageError as exc:
        raise Exit(str(exc), code=2)
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    gateways = _gateways(play, hosts)
    with play.connections() as connections:
        outputs, problems = collect(connections, {g: usage_command(first) for g in gateways})
    found = Usage(first)
    for gateway, output in sorted(outputs.items()):
        found.add(gateway, output)
    found = found.only(key)
    found.problems += [f"{host}: {problem}" for host, problem in sorted(problems.items())]
    if json:
        write_json(found.as_dict(), json)
    else:
        print("\n".join(table_lines(found)))
    for problem in found.problems:
        print(problem, file=sys.stderr)
    if problems:
        raise Exit(code=1)


@task(help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"], "json": runs.HELP["json"],
            "show_keys": "print the api_key_file key instead of ********"})
def endpoints(c, inventory=None, hosts=None, show_keys=False, json=None):
    """Where the fleet answers (https), the CA file to trust, and the lines Open WebUI takes."""
    from converge.report import write_json
    from day2.endpoints import api_key, endpoints as endpoints_of, monitoring, monitoring_lines, open_webui_lines
    runs.writable(json)
    play = runs.load_play(inventory)
    from serving.fleet import is_gateway, is_monitoring, is_serving
    selected = {h: play.hostvars(h) for h in runs.select(play, hosts)}
    gateways = {h: v for h, v in selected.items() if is_gateway(v)}
    doc = endpoints_of({h: v for h, v in selected.items() if is_serving(v)}, gateways)
    doc["monitoring"] = monitoring({h: v for h, v in selected.items() if is_monitoring(v)})
    if json:
        write_json(doc, json)
        return
    key, problem = api_key(selected, show_keys)
    if doc["gateway"]:
        print(f"{'gateway':<12} {doc['gateway']}")
    for row in doc["hosts"]:
        print(f"{row['host']:<12} {row['url']}")
    print(f"{'CA file':<12} {doc['ca_file']}")
    if problem:
        print(f"  {problem}", file=sys.stderr)
    print()
    print(open_webui_lines(doc, key), end="")
    if doc["monitoring"]:
        print()
        print(monitoring_lines(doc["monitoring"]), end="")


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"],
                            "json": "write the figures as JSON to FILE",
                            "csv": "write the figures as CSV to FILE",
                            "repeats": "sequential requests per scenario (default 4)",
                            "concurrency": "parallel requests of the aggregate figure (default 4)",
                            "ask_become_pass": runs.HELP["ask_become_pass"]})
def bench(c, inventory=None, hosts=None, json="bench.json", csv="bench.csv", repeats=4, concurrency=4,
          ask_become_pass=False):
    """Benchmark each serving host the seeds' way: full canvas, short answers, concurrency 4."""
    from day2.benchmark_run import bench_hosts
    runs.writable(json)
    runs.writable(csv, "--csv")
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    if not bench_hosts(play, runs.select(play, hosts), json, csv, int(repeats), int(concurrency)):
        raise Exit(code=1)


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"],
                                 "once": "print one view and end (for scripts and pipes)",
                                 "json": "write one view as JSON to FILE ('-' for standard output) and end",
                                 "every": "seconds between two refreshes (default 2)",
                                 "source": "auto (Prometheus when a monitoring host answers, else the hosts), "
                                           "prometheus or hosts",
                                 "ask_become_pass": runs.HELP["ask_become_pass"]})
def top(c, inventory=None, hosts=None, once=False, json=None, every="2", source="auto", ask_become_pass=False):
    """The fleet live: per replica requests, tokens/s, time to first token, KV cache, GPU, errors; firing alerts."""
    from day2.top_run import run as watch
    runs.writable(json)
    if source not in ("auto", "prometheus", "hosts"):
        raise Exit(f"--source {source}: expected auto, prometheus or hosts", code=2)
    try:
        every = float(every)
    except ValueError:
        every = -1
    if not 0.5 <= every <= 3600:
        raise Exit("--every: expected seconds between 0.5 and 3600", code=2)
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    try:
        ok = watch(play, runs.select(play, hosts), once, json, every, source)
    except ConvergeError as exc:
        raise Exit(str(exc), code=2)
    if not ok:
        raise Exit(code=1)


@task(klass=runs.HostTask, help={
    "inventory": runs.HELP["inventory"],
    "hosts": "the one serving host to tune (one of its diffusion replicas takes the trials)",
    "bounds": "the entropy bounds to try, comma-separated (e.g. 0.05,0.1,0.2): each greater than 0, at most 10",
    "prompts": "your prompts: a text file, one a line (# comments skipped), or a YAML/JSON list of prompts "
               "(each a string or {prompt: ..., max_tokens: N})",
    "repeats": "times each prompt is sent at each bound (default 1)",
    "max_tokens": "max_tokens of a prompt that sets none (default 512)",
    "json": runs.HELP["json"],
    "answers": "the page with the answers side by side, a bound a column (default tune-answers.html)",
    "apply": "write this bound into the inventory (the host's file, or --group's) and roll the host's replicas to "
             "it; alone, or after the trials",
    "group": "with --apply: write the bound into this group's file (group_vars/GROUP.yml) instead of the host's "
             "(its other hosts take it at their next deploy)",
    "replica": "the diffusion replica that takes the trials (its index; default: the host's first)",
    "timeout": "seconds a prompt's answer may take (default 300)",
    "ask_become_pass": runs.HELP["ask_become_pass"]})
def tune(c, inventory=None, hosts=None, bounds=None, prompts=None, repeats=1, max_tokens=512, json=None,
         answers="tune-answers.html", apply=None, group=None, replica=None, timeout=300, ask_become_pass=False):
    """Try entropy bounds on one replica, held out of service, with your prompts; then back (or --apply one)."""
    from day2.tune import TuneError, parse_bound, parse_bounds, read_prompts
    from day2.tune_run import run as tune_run
    from serving.fleet import is_serving
    runs.writable(json)
    runs.writable(answers, "--answers")
    try:
        if bounds is None and prompts is None and apply is None:
            raise TuneError("give --bounds and --prompts to try bounds, and/or --apply BOUND to set one")
        if (bounds is None) != (prompts is None):
            raise TuneError(f"{'--bounds' if bounds is not None else '--prompts'} goes with "
                            f"{'--prompts FILE' if bounds is not None else '--bounds B1,B2,...'}: the trials need both")
        if group is not None and apply is None:
            raise TuneError("--group says where --apply writes the bound: give --apply BOUND too")
        if not 1 <= int(repeats) <= 100:
            raise TuneError(f"--repeats {repeats}: from 1 to 100")
        if not 1 <= int(max_tokens) <= 1048576:
            raise TuneError(f"--max-tokens {max_tokens}: from 1 to 1048576")
        tried = parse_bounds(bounds) if bounds is not None else []
        asked = read_prompts(prompts, int(max_tokens)) if prompts is not None else []
        applied = parse_bound(apply) if apply is not None else None
    except TuneError as exc:
        raise Exit(str(exc), code=2)
    index = _replica(replica)
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    selected = runs.select(play, hosts)
    if len(selected) != 1 or not is_serving(play.hostvars(selected[0])):
        serving = [h for h in play.inventory.host_names if is_serving(play.hostvars(h))]
        raise Exit(f"--hosts {hosts or '(all)'}: tune takes one serving host ({', '.join(serving) or 'none here'})",
                   code=2)
    host = selected[0]
    if group is not None:
        groups = play.hostvars(host)["group_names"]
        if group not in groups:
            raise Exit(f"--group {group}: {host} is not in it (its groups: {', '.join(groups) or 'none'})", code=2)
    code = tune_run(play, lambda path: runs.load_play(path, ask_become_pass=False), runs.run, inventory, host, tried,
                    asked, int(repeats), json, answers, applied,
                    ("group_vars", group) if group else ("host_vars", host), index, float(timeout))
    if code:
        raise Exit(code=code)


@task(klass=runs.HostTask, help={"inventory": runs.HELP["inventory"], "hosts": runs.HELP["hosts"],
                                 "json": runs.HELP["json"], "ask_become_pass": runs.HELP["ask_become_pass"],
                                 "check": "remove nothing: list what would go, each with its size and what it frees",
                                 "keep": "earlier releases kept on each host besides what its replicas run (default 1: "
                                         "the rollback target; 0 keeps only what runs)",
                                 **runs.SERIAL_HELP})
def prune(c, inventory=None, hosts=None, check=False, keep=1, json=None, ask_become_pass=False, serial=None,
          max_fail=None):
    """Remove the fleet's old images and weights no replica runs, keeping the rollback target (--keep N)."""
    from day2.prune import prune_role
    from day2.prune_table import print_prune, prune_document
    if not str(keep).isdigit() or int(keep) > 100:
        raise Exit(f"--keep {keep}: expected how many earlier releases to keep, 0 to 100", code=2)
    runs.check_batches(serial, max_fail)
    play = runs.load_play(inventory, ask_become_pass=ask_become_pass)
    report = runs.run(play, [prune_role(int(keep))], hosts, json, check=check, serial=serial, max_fail=max_fail,
                      title="CHECK RECAP (nothing was removed)" if check else "PRUNE RECAP")
    data = prune_document(report, check)
    print_prune(data, report.console)
    runs.finish(report, data, json)


ns = Collection(status, start, stop, restart, recover, logs, endpoints, bench, top, usage, tune, prune)
