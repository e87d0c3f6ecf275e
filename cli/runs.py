"""What every task shares: the options' help, the task class that reaches hosts, and
the one way a task loads the inventory, runs roles on hosts and ends (its errors
turned into the same messages and exit codes: 2 bad input or settings, 1 a host
failed, 130/143 Ctrl-C/SIGTERM)."""
from __future__ import annotations

from invoke import Exit, Task
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


def become_password(ask: bool) -> str | None:
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


def load_play(inventory, overrides=None, ask_become_pass=False):
    import roles
    from converge.play import Play
    try:
        from kubernetes_manifests.collect import schema as kubernetes_schema
        # the roles' variables, and the render's for Kubernetes (which the roles never read)
        play = Play.load(inventory, (*roles.schemas(), kubernetes_schema()), roles.defaults(), overrides,
                         path_variable=roles.INVENTORY_VARIABLE)
        play.check()
        catalogs = roles.problems()
        if catalogs:
            raise InventoryError(catalogs)
    except InventoryError as exc:
        raise Exit("inventory check failed:\n  " + "\n  ".join(exc.problems), code=2)
    play.become_password = become_password(ask_become_pass)
    return play


def where_set(play, host: str, keypath: tuple) -> str | None:
    """``file:line`` of the value of ``keypath`` in force for ``host`` (the last source that sets
    its top key), or None where nothing sets it."""
    resolved = play.inventory.host(host, play.defaults, play.overrides)
    setter = next((src for src in reversed(resolved.sources) if keypath[0] in (src.values or {})), None)
    return str(setter.origin_of(keypath)) if setter is not None else None


def writable(target, option="--json"):
    """Refuse a --json/--junit file that cannot be written before any host is touched."""
    import os
    if target and target != "-":
        folder = os.path.dirname(os.path.abspath(target))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK) or os.path.isdir(target):
            raise Exit(f"{option} {target}: cannot write there (no such folder, not writable, or a folder): "
                       f"give a file in a folder you can write", code=2)


def select(play, hosts):
    try:
        return play.inventory.select(hosts)
    except InventoryError as exc:
        raise Exit("\n".join(exc.problems), code=2)


def report_for(json_target, show_diff=False, quiet=False):
    import os
    writable(json_target)
    from rich.console import Console
    from converge.progress import every_from
    from converge.report import Report
    from roles import PROGRESS_VARIABLE
    # with --json -, people's lines go to stderr so that stdout stays JSON
    return Report(console=Console(stderr=json_target == "-", highlight=False), show_diff=show_diff, quiet=quiet,
                  progress_every_s=every_from(os.environ.get(PROGRESS_VARIABLE)))


def run(play, roles, hosts, json_target=None, *, title=None, show_diff=False, check=False, **options):
    """The one way a task runs roles on hosts: the engine's errors are exit 2 with
    their message, a recap is printed under ``title`` (none: quiet, the task prints
    its own table). Returns the report; `finish` ends the task. A host off the serving
    path (roles.advisory: a monitoring host) is reported, and fails the run only when
    nothing else ran."""
    from converge import play as playlib
    from roles import LOCK_NAME, advisory
    from serving.fleet import FleetService
    report = report_for(json_target, show_diff, quiet=title is None)
    selected = select(play, hosts)
    off_path = frozenset(h for h in selected if advisory(play.hostvars(h)))
    report.advisory = off_path if off_path != frozenset(selected) else frozenset()
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


def finish(report, document, json_target, ok=None):
    """Write ``--json`` and exit as every task does: 130 after Ctrl-C, 143 after
    SIGTERM (as a shell reports them), 1 when a host failed (or ``ok`` is false)."""
    from converge.report import write_json
    write_json(document, json_target)
    if report.interrupted:
        raise Exit(code=143 if report.interrupted == "SIGTERM" else 130)
    if report.failed if ok is None else not ok:
        raise Exit(code=1)


def check_batches(serial, max_fail):
    """``--serial`` and ``--max-fail`` checked before any host is touched."""
    from converge.batches import BatchError, parse
    try:
        if serial is not None:
            parse(serial, "--serial")
        if max_fail is not None:
            if serial is None:
                raise BatchError(f"--max-fail {max_fail}: it counts the failed hosts of a batch; give --serial too")
            parse(max_fail, "--max-fail", zero=True)
    except BatchError as exc:
        raise Exit(str(exc), code=2)


SERIAL_HELP = {"serial": "hosts in batches of N (or N%), each batch done before the next (Ansible's serial; "
                         "default: all at once)",
               "max_fail": "with --serial: stop after a batch in which more than N (or N%) of its hosts failed "
                           "(default 0: any failure stops the run)"}
