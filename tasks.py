"""Invoke tasks: thin wrappers that parse options and call the engine.

    invoke inventory.check
    invoke facts --hosts spark01 [--local] [--json -]
    invoke deploy --hosts spark01,rtx01 [--check] [--diff] [--forks 10] [--serial N|N%] [--max-fail N|N%] [--set key=value]
    invoke verify [--hosts ...] [--junit FILE] [--json FILE]
    invoke trust --hosts ...
    invoke lab.up | lab.status | lab.down
"""
from __future__ import annotations

import sys

from invoke import Collection, Exit, Task, task
from invoke.exceptions import ParseError
from invoke.parser import Argument

from converge.errors import ConvergeError, InventoryError

HELP = {
    "inventory": "inventory folder (default: $DGEMMA_INVENTORY or inventory/)",
    "hosts": "comma-separated hosts or groups (default: all)",
    "json": "write the result as JSON to FILE ('-' for standard output)",
    "set": "override a variable for this run: key=value (repeatable)",
    "ask_become_pass": "ask once for the sudo password of hosts with ansible_become (Ansible's -K)",
}


class CheckedArgument(Argument):
    """A whole-number option whose value is not one is a parse error that names the
    option (invoke's own int() raised a traceback); the kind stays int, so --help
    still shows INT."""

    def set_value(self, value, cast=True):
        try:
            super().set_value(value, cast)
            whole = not cast or self.value >= 0
        except ValueError:
            whole = False
        if not whole:
            raise ParseError(f"--{self.name.replace('_', '-')} {value}: expected a whole number (0 or more)")


class HostTask(Task):
    """A task that reaches hosts: ``--ask-become-pass`` is ``-K``, as in Ansible;
    whole-number options are checked (CheckedArgument)."""

    def arg_opts(self, name, default, taken_names):
        opts = super().arg_opts(name, default, taken_names)
        if name == "ask_become_pass":
            opts["names"] = ["ask-become-pass", "K"]
        return opts

    def get_arguments(self, ignore_unknown_help=None):
        args = super().get_arguments(ignore_unknown_help)
        for arg in args:
            if arg.kind is int:
                arg.__class__ = CheckedArgument
        return args


def _become_password(ask: bool) -> str | None:
    """Asked once per run, on the terminal, not echoed (getpass)."""
    if not ask:
        return None
    import getpass
    from converge.become import check_password
    try:
        with open("/dev/tty"):
            pass
    except OSError:
        raise Exit("--ask-become-pass (-K) needs a terminal to ask on; without one, set become_password_file "
                   "to a 0600 file holding the password", code=2)
    try:
        return check_password(getpass.getpass("BECOME password: "), "--ask-become-pass")
    except ValueError as exc:
        raise Exit(str(exc), code=2)
    except (EOFError, KeyboardInterrupt):
        raise Exit("no become password given", code=2)


def _play(inventory, overrides=None, ask_become_pass=False):
    import roles
    from converge.play import Play
    try:
        play = Play.load(inventory, roles.schemas(), roles.defaults(), overrides,
                         path_variable=roles.INVENTORY_VARIABLE)
        play.check()
        catalogs = roles.problems()
        if catalogs:
            raise InventoryError(catalogs)
    except InventoryError as exc:
        raise Exit("inventory check failed:\n  " + "\n  ".join(exc.problems), code=2)
    play.become_password = _become_password(ask_become_pass)
    return play


def _writable(target, option="--json"):
    """Refuse a --json/--junit file that cannot be written before any host is touched."""
    import os
    if target and target != "-":
        folder = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(target):
            raise Exit(f"{option} {target}: cannot write there (no such folder, not writable, or a folder): "
                       f"give a file in a folder you can write", code=2)


def _select(play, hosts):
    try:
        return play.inventory.select(hosts)
    except InventoryError as exc:
        raise Exit("\n".join(exc.problems), code=2)


def _report(json_target, show_diff=False, quiet=False):
    import os
    _writable(json_target)
    from rich.console import Console
    from converge.progress import every_from
    from converge.report import Report
    from roles import PROGRESS_VARIABLE
    # with --json -, people's lines go to stderr so that stdout stays JSON
    return Report(console=Console(stderr=json_target == "-", highlight=False), show_diff=show_diff, quiet=quiet,
                  progress_every_s=every_from(os.environ.get(PROGRESS_VARIABLE)))


def _run(play, roles, hosts, json_target=None, *, title=None, show_diff=False, check=False, **options):
    """The one way a task runs roles on hosts: the engine's errors are exit 2 with
    their message, a recap is printed under ``title`` (none: quiet, the task prints
    its own table). Returns the report; `_finish` ends the task."""
    from converge import play as playlib
    from roles import LOCK_NAME
    from roles.fleet import FleetService
    report = _report(json_target, show_diff, quiet=title is None)
    # every host's roles see the whole fleet (a gateway lists every front door), whichever hosts run
    fleet = FleetService({h: play.hostvars(h) for h in play.inventory.host_names})
    options["services"] = (fleet, *options.get("services", ()))
    try:
        playlib.run(play, roles, hosts, report=report, check=check, lock_name=LOCK_NAME, **options)
    except ConvergeError as exc:
        raise Exit(str(exc), code=2)
    if title:
        report.print_recap(title)
    return report


def _finish(report, document, json_target, ok=None):
    """Write ``--json`` and exit as every task does: 130 after Ctrl-C, 143 after
    SIGTERM (as a shell reports them), 1 when a host failed (or ``ok`` is false)."""
    from converge.report import write_json
    write_json(document, json_target)
    if report.interrupted:
        raise Exit(code=143 if report.interrupted == "SIGTERM" else 130)
    if report.failed if ok is None else not ok:
        raise Exit(code=1)


@task(help={"inventory": HELP["inventory"], "set": HELP["set"]}, iterable=["set"])
def inventory_check(c, inventory=None, set=None):
    """Validate the inventory and every host's variables against the schemas."""
    play = _play(inventory, set)
    hosts = play.inventory.host_names
    listed = ", ".join(hosts[:12]) + (f", … ({len(hosts) - 12} more)" if len(hosts) > 12 else "")
    print(f"{play.inventory.root}: {len(hosts)} hosts ({listed}), {len(play.inventory.groups) - 1} groups: OK")


@task(klass=HostTask, help={"inventory": HELP["inventory"], "hosts": HELP["hosts"], "json": HELP["json"],
                            "local": "read this machine through a local connection instead of SSH",
                            "set": HELP["set"], "ask_become_pass": HELP["ask_become_pass"]},
      iterable=["set"])
def facts(c, inventory=None, hosts=None, local=False, json=None, set=None, ask_become_pass=False):
    """Gather facts and show the chosen image, model and memory, with reasons."""
    from roles.preflight import show
    from roles.preflight.role import FACTS_ROLE
    play = _play(inventory, set, ask_become_pass and not local)
    report = _run(play, [FACTS_ROLE], hosts, json, local=local)
    data = show.facts_document(report)
    show.print_tables(report, data, console=report.console)
    _finish(report, data, json)


@task(klass=HostTask, help={"inventory": HELP["inventory"], "hosts": HELP["hosts"], "json": HELP["json"],
                            "set": HELP["set"], "ask_become_pass": HELP["ask_become_pass"],
                            "check": "change nothing; show the diffs and commands a real run would make",
                            "diff": "show diffs of changed files", "forks": "hosts converged at once (default 10)",
                            "lock_wait": "seconds to wait for another run's lock on a host (default 300)",
                            "serial": "hosts in batches of N (or N%), each batch done before the next (Ansible's "
                                      "serial; default: all at once)",
                            "max_fail": "with --serial: stop after a batch in which more than N (or N%) of its hosts "
                                        "failed (default 0: any failure stops the run)"},
      iterable=["set"])
def deploy(c, inventory=None, hosts=None, check=False, diff=False, forks=10, json=None, set=None, lock_wait=300,
           ask_become_pass=False, serial=None, max_fail=None):
    """Converge hosts: image, weights, systemd unit, started and answering."""
    import roles
    from converge.batches import BatchError, parse
    from relay.service import RelayService
    try:
        if serial is not None:
            parse(serial, "--serial")
        if max_fail is not None:
            if serial is None:
                raise BatchError(f"--max-fail {max_fail}: it counts the failed hosts of a batch; give --serial too")
            parse(max_fail, "--max-fail", zero=True)
    except BatchError as exc:
        raise Exit(str(exc), code=2)
    play = _play(inventory, set, ask_become_pass)
    report = _run(play, roles.load(), hosts, json, title="CHECK RECAP (nothing was changed)" if check else "PLAY RECAP",
                  show_diff=diff or check, check=check, forks=int(forks), lock_wait=float(lock_wait),
                  services=(RelayService(),), serial=serial, max_fail=max_fail)
    _finish(report, report.as_dict(), json)


@task(help={"inventory": HELP["inventory"], "hosts": HELP["hosts"],
            "yes": "pin the keys shown without asking"})
def trust(c, inventory=None, hosts=None, yes=False):
    """Show and pin host keys: each jump host's on the way, then the host's own."""
    from converge import hostkeys
    from converge.ssh_settings import SSHSettings
    from converge.trust import walk
    play = _play(inventory)
    failed = False

    def decide(seen):
        print(f"{name}: {seen.label + ' ' if seen.label != name else ''}{seen.where} {seen.key.get_name()} "
              f"{hostkeys.fingerprint(seen.key)}")
        if yes:
            return True
        if not sys.stdin.isatty():
            print("  not pinned: run with --yes, or from a terminal, after checking the fingerprint")
            return False
        return input("  trust this key? [y/N] ").strip().lower() in ("y", "yes")

    for name in _select(play, hosts):
        try:
            # trust needs no become password: only the way in
            settings = SSHSettings.from_vars(name, {**play.hostvars(name), "ansible_become": False})
            seen = walk(settings, decide)
        except ConvergeError as exc:
            print(str(exc))
            failed = True
            continue
        for entry in seen:
            what = entry.label + " " if entry.label != name else ""
            if entry.state == "trusted":
                print(f"{name}: {what}{entry.where} {entry.key.get_name()} {hostkeys.fingerprint(entry.key)} "
                      f"already trusted")
            elif entry.state == "pinned":
                print(f"  pinned in {settings.known_hosts or hostkeys.USER_KNOWN_HOSTS}")
            elif entry.state == "changed":
                print(f"{name}: {what}{entry.where} offers {hostkeys.fingerprint(entry.key)} but known_hosts has "
                      f"{hostkeys.fingerprint(entry.expected)}. Remove the old key first if the machine was "
                      f"reinstalled: ssh-keygen -R '{entry.where}' -f "
                      f"{settings.known_hosts or hostkeys.USER_KNOWN_HOSTS}")
                failed = True
            else:
                failed = failed or not yes
    if failed:
        raise Exit(code=1)


inventory_ns = Collection("inventory")
inventory_ns.add_task(inventory_check, name="check")

ns = Collection(facts, deploy, trust)
ns.add_collection(inventory_ns)

try:  # the lab and verify are added when their modules are present
    from lab import tasks as lab_tasks
    ns.add_collection(lab_tasks.ns, name="lab")
except ImportError as exc:  # pragma: no cover
    if "lab" not in str(exc):
        raise


@task(klass=HostTask, help={"inventory": HELP["inventory"], "hosts": HELP["hosts"], "json": HELP["json"],
                            "set": HELP["set"], "junit": "write JUnit XML to FILE",
                            "ask_become_pass": HELP["ask_become_pass"]}, iterable=["set"])
def verify(c, inventory=None, hosts=None, json=None, junit=None, set=None, ask_become_pass=False):
    """Check every host with testinfra over SSH: units, secrets, image, weights, API."""
    from pathlib import Path
    import roles
    from converge import verify as verifylib
    from converge.verify_report import print_table, verify_document
    _writable(junit, "--junit")
    play = _play(inventory, set, ask_become_pass)
    with play.connections() as connections:  # the check run and the checks: one connection per host
        # what each host should look like: the roles' plan in check mode (changes nothing)
        report = _run(play, roles.load(), hosts, json, check=True, connections=connections)
        expected = {h: {**x.get("expected", {}), "frontdoor": x.get("frontdoor"), "gateway": x.get("gateway")}
                    for h, x in report.extra.items() if "expected" in x or "gateway" in x}
        # hosts the check run could not reach or become on are failures of their own
        unreachable = {t.host: t.message for t in report.tasks if t.status == "unreachable"
                       or (t.role == "connect" and t.status == "failed")}
        reached = {h: t for h, t in connections.opened().items() if h not in unreachable}
        results, output = verifylib.run(reached, [str(Path(roles.HERE))], expected, junit=junit) \
            if reached else ([], "")
    data = verify_document(results, unreachable, expected)
    print_table(data, report.console)
    if not results and reached:
        report.console.print(output[-3000:])
    _finish(report, data, json, ok=data["ok"])


ns.add_task(verify)


def _ops(inventory, hosts, role, set=None, json_target=None, title="RECAP", ask_become_pass=False):
    """Run one day-2 role on hosts through the engine (connection, lock, report)."""
    play = _play(inventory, set, ask_become_pass)
    report = _run(play, [role], hosts, json_target, title=title)
    _finish(report, report.as_dict(), json_target)


@task(klass=HostTask, help={"inventory": HELP["inventory"], "hosts": HELP["hosts"], "json": HELP["json"],
                            "ask_become_pass": HELP["ask_become_pass"]})
def status(c, inventory=None, hosts=None, json=None, ask_become_pass=False):
    """One table for the fleet: unit, container, health, model, image, GPU memory, drift."""
    import roles
    from day2.status import gateway_status_role, status_role
    from day2.status_table import print_status, status_document
    play = _play(inventory, ask_become_pass=ask_become_pass)
    report = _run(play, roles.load() + [status_role(), gateway_status_role()], hosts, json, check=True)
    data = status_document(report)
    print_status(data, report.console)
    _finish(report, data, json, ok=data["ok"])


OPS_HELP = {"inventory": HELP["inventory"], "hosts": HELP["hosts"], "json": HELP["json"], "set": HELP["set"],
            "ask_become_pass": HELP["ask_become_pass"],
            "replica": "act on this replica alone (its index, as invoke status shows it; default: all of them)"}


def _replica(value) -> int | None:
    """``--replica N``: a replica's index, or None for all of them."""
    if value is None:
        return None
    if not str(value).isdigit():
        raise Exit(f"--replica {value}: expected a replica's index (0, 1, ...; invoke status shows them)", code=2)
    return int(value)


@task(klass=HostTask, help=OPS_HELP, iterable=["set"])
def start(c, inventory=None, hosts=None, json=None, set=None, ask_become_pass=False, replica=None):
    """Start vLLM's replicas (stopping the units they conflict with, e.g. ollama) and wait until ready."""
    from day2.lifecycle import start_role
    _ops(inventory, hosts, start_role(replica=_replica(replica)), set, json_target=json, ask_become_pass=ask_become_pass)


@task(klass=HostTask, help={**OPS_HELP, "resume": "start again the units vLLM conflicts with (e.g. ollama)"},
      iterable=["set"])
def stop(c, inventory=None, hosts=None, resume=False, json=None, set=None, ask_become_pass=False, replica=None):
    """Stop vLLM's replicas; with --resume, start the units they displaced."""
    from day2.lifecycle import stop_role
    _ops(inventory, hosts, stop_role(resume, _replica(replica)), set, json_target=json, ask_become_pass=ask_become_pass)


@task(klass=HostTask, help=OPS_HELP, iterable=["set"])
def restart(c, inventory=None, hosts=None, json=None, set=None, ask_become_pass=False, replica=None):
    """Restart vLLM's replicas and wait until ready."""
    from day2.lifecycle import restart_role
    _ops(inventory, hosts, restart_role(replica=_replica(replica)), set, json_target=json, ask_become_pass=ask_become_pass)


@task(klass=HostTask, help=OPS_HELP, iterable=["set"])
def recover(c, inventory=None, hosts=None, json=None, set=None, ask_become_pass=False, replica=None):
    """Clear a crash loop or a wedged container; refuse (reboot needed) if nvidia-smi hangs."""
    from day2.lifecycle import recover_role
    _ops(inventory, hosts, recover_role(_replica(replica)), set, json_target=json, title="RECOVER RECAP",
         ask_become_pass=ask_become_pass)


@task(klass=HostTask, help={"inventory": HELP["inventory"], "hosts": HELP["hosts"],
                            "lines": "lines of history (default 50)",
                            "follow": "keep printing new lines (Ctrl-C to stop)",
                            "replica": OPS_HELP["replica"],
                            "ask_become_pass": HELP["ask_become_pass"]})
def logs(c, inventory=None, hosts=None, lines=50, follow=False, ask_become_pass=False, replica=None):
    """The journal of vLLM's replicas on each host, prefixed by host."""
    from day2.logs import stream_logs
    play = _play(inventory, ask_become_pass=ask_become_pass)
    failed = stream_logs(play, _select(play, hosts), int(lines), follow, replica=_replica(replica))
    if failed:
        raise Exit(code=1)


@task(help={"inventory": HELP["inventory"], "hosts": HELP["hosts"], "json": HELP["json"],
            "show_keys": "print the api_key_file key instead of ********"})
def endpoints(c, inventory=None, hosts=None, show_keys=False, json=None):
    """Where the fleet answers (https), the CA file to trust, and the lines Open WebUI takes."""
    from converge.report import write_json
    from day2.endpoints import api_key, endpoints as endpoints_of, open_webui_lines
    _writable(json)
    play = _play(inventory)
    from roles.fleet import is_gateway
    selected = {h: play.hostvars(h) for h in _select(play, hosts)}
    gateways = {h: v for h, v in selected.items() if is_gateway(v)}
    doc = endpoints_of({h: v for h, v in selected.items() if h not in gateways}, gateways)
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


def _keys_reload(c, inventory, hosts, ask_become_pass):
    """Every front door takes the new key list (a reload; vLLM keeps running)."""
    from roles.frontdoor.role import KEYS_ROLE
    from roles.gateway.role import KEYS_ROLE as GATEWAY_KEYS_ROLE
    play = _play(inventory, ask_become_pass=ask_become_pass)
    report = _run(play, [KEYS_ROLE, GATEWAY_KEYS_ROLE], hosts, None, title="KEYS RECAP")
    return report


def _key_store(inventory):
    from credentials import directory
    from credentials.keys import KeyStore
    play = _play(inventory)
    return KeyStore(directory(play.hostvars(play.inventory.host_names[0]) if play.inventory.host_names else None))


KEYS_HELP = {"inventory": HELP["inventory"], "hosts": "front doors and gateways to reload (default: all)",
             "ask_become_pass": HELP["ask_become_pass"]}


@task(klass=HostTask, help={**KEYS_HELP, "name": "whose key (letters, digits, . _ @ -)"})
def keys_add(c, name, inventory=None, hosts=None, ask_become_pass=False):
    """Make a key for NAME, reload the front doors, and print the key once (last line of stdout)."""
    from credentials import CredentialError
    if name.startswith("-"):
        raise Exit(f"{name}: expected a key's name; usage: invoke keys.add NAME (help: invoke --help keys.add)",
                   code=2)
    try:
        secret = _key_store(inventory).add(name)
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    report = _keys_reload(c, inventory, hosts, ask_become_pass)
    if report.failed:
        print("the key is stored; the front doors above that failed still refuse it until they take it "
              "(invoke deploy, or invoke keys add again after revoking)", file=sys.stderr)
    # alone on the last line of stdout: the one time it is shown; only its sha256 is kept
    print(secret, flush=True)
    if report.failed:
        raise Exit(code=1)


@task(klass=HostTask, help={**KEYS_HELP, "name": "whose key"})
def keys_revoke(c, name, inventory=None, hosts=None, ask_become_pass=False):
    """Forget NAME's key and reload the front doors: it is refused (401) when this returns."""
    from credentials import CredentialError
    try:
        _key_store(inventory).revoke(name)
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    report = _keys_reload(c, inventory, hosts, ask_become_pass)
    if report.failed:
        raise Exit(code=1)


@task(help={"inventory": HELP["inventory"]})
def keys_list(c, inventory=None):
    """The keys' names, when they were made, and the start of their sha256 (never a key)."""
    from credentials import CredentialError
    try:
        store = _key_store(inventory)
        data = store.load()
    except CredentialError as exc:
        raise Exit(str(exc), code=2)
    if not data:
        print(f"no keys in {store.path}: invoke keys add NAME")
    for name, entry in sorted(data.items()):
        print(f"{name:<24} added {entry.get('added', '?'):<26} sha256 {entry['sha256'][:12]}…")


keys_ns = Collection("keys")
keys_ns.add_task(keys_add, name="add")
keys_ns.add_task(keys_revoke, name="revoke")
keys_ns.add_task(keys_list, name="list")
ns.add_collection(keys_ns)


@task(klass=HostTask, help={"inventory": HELP["inventory"], "hosts": HELP["hosts"], "set": HELP["set"],
                            "format": "systemd (the unit) or nixos (a NixOS oci-containers module)",
                            "ask_become_pass": HELP["ask_become_pass"]}, iterable=["set"])
def render(c, inventory=None, hosts=None, format="systemd", set=None, ask_become_pass=False):
    """Print the unit (or NixOS module) deploy would write, for hosts you manage yourself."""
    from roles.preflight.role import FACTS_ROLE
    from roles.service.render import FORMATS, RENDER_ROLE
    if format not in FORMATS:
        raise Exit(f"--format {format}: expected one of {', '.join(FORMATS)}", code=2)
    play = _play(inventory, set, ask_become_pass)
    report = _run(play, [FACTS_ROLE, RENDER_ROLE], hosts, check=True)
    failed = False
    for host in report.recap:
        rendered = report.extra.get(host, {}).get("render")
        if not rendered:
            problems = [t.message for t in report.tasks if t.host == host and t.status in ("failed", "unreachable")]
            print(f"# {host}: nothing to render: {'; '.join(problems) or 'no choice of image and model'}",
                  file=sys.stderr)
            failed = True
            continue
        for path, text in rendered[format]:
            print(f"# ---- {host}: {path}")
            print(text, end="")
    _finish(report, None, None, ok=not failed)


@task(klass=HostTask, help={"inventory": HELP["inventory"], "hosts": HELP["hosts"],
                            "json": "write the figures as JSON to FILE",
                            "csv": "write the figures as CSV to FILE",
                            "repeats": "sequential requests per scenario (default 4)",
                            "concurrency": "parallel requests of the aggregate figure (default 4)",
                            "ask_become_pass": HELP["ask_become_pass"]})
def bench(c, inventory=None, hosts=None, json="bench.json", csv="bench.csv", repeats=4, concurrency=4,
          ask_become_pass=False):
    """Benchmark each serving host the seeds' way: full canvas, short answers, concurrency 4."""
    from day2.benchmark_run import bench_hosts
    _writable(json)
    _writable(csv, "--csv")
    play = _play(inventory, ask_become_pass=ask_become_pass)
    if not bench_hosts(play, _select(play, hosts), json, csv, int(repeats), int(concurrency)):
        raise Exit(code=1)


for day2 in (status, start, stop, restart, recover, logs, endpoints, bench, render):
    ns.add_task(day2)
