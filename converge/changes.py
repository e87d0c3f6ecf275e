"""Steps a role yields, how each decides whether the host must change, and the
scripts that change it: atomic file writes (temp file, then rename, keeping the
previous version beside it) and plain commands.
"""
from __future__ import annotations

import base64
import difflib
import hashlib
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Generic, TypeVar

from .errors import StepFailed
from .shell_files import as_sent

T = TypeVar("T")

MASK = "********"


@dataclass
class Step:
    name: str
    notify: tuple = ()

    def needed(self) -> bool:
        return True


@dataclass
class Check(Step):
    """A condition the host must meet; ``message`` says the remedy when it fails."""

    ok: bool = True
    message: str = ""


@dataclass
class File(Step):
    """A file with this content, mode and owner. ``current`` is its FileState fact.

    A secret file's content is compared by hash and never shown in a diff.
    """

    path: str = ""
    content: str = ""
    mode: str = "0644"
    owner: str = "root"
    group: str = "root"
    secret: bool = False
    current: dict | None = None
    keep_previous: bool = True

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content.encode()).hexdigest()

    def needed(self) -> bool:
        cur = self.current
        return (cur is None or cur["sha256"] != self.sha256 or cur["mode"] != self.mode.rjust(4, "0")
                or cur["owner"] != self.owner or cur["group"] != self.group)

    def is_env(self) -> bool:
        """An environment file (KEY=value lines: systemd's EnvironmentFile), by its name."""
        return self.path.endswith(".env")

    def content_changed(self) -> bool:
        return self.current is None or self.current["sha256"] != self.sha256

    def diff(self) -> str:
        cur = self.current
        if self.secret:
            # the host's secret never comes back; show which keys we write, never their values
            old = [] if cur is None else [f"(secret content, sha256 {cur['sha256'][:12]})\n"]
            new = [f"(secret content, sha256 {self.sha256[:12]})\n"] + mask_secret(self.content, self.is_env()).splitlines(keepends=True)
            text = "".join(difflib.unified_diff(old, new, f"{self.path} (on host)" if cur else "/dev/null",
                                                 f"{self.path} (wanted)"))
        else:
            old = "" if cur is None else cur.get("content", "")
            text = "".join(difflib.unified_diff(old.splitlines(keepends=True), self.content.splitlines(keepends=True),
                                                 f"{self.path} (on host)" if cur else "/dev/null",
                                                 f"{self.path} (wanted)"))
        if cur is not None and (cur["mode"] != self.mode.rjust(4, "0") or cur["owner"] != self.owner
                                or cur["group"] != self.group):
            text += (f"  mode/owner {cur['mode']} {cur['owner']}:{cur['group']} -> "
                     f"{self.mode.rjust(4, '0')} {self.owner}:{self.group}\n")
        return text

    def script(self) -> str:
        return atomic_write_script(self.path, self.content.encode(), self.mode, self.owner, self.group,
                                   self.keep_previous)

    def write_call(self) -> str:
        """The write alone, for a program that has write_file.sh's library (WRITE_FILE)."""
        return write_file_call(self.path, self.content.encode(), self.mode, self.owner, self.group,
                               self.keep_previous)


ENV_LINE = re.compile(r"\s*(export\s+)?[A-Za-z_][A-Za-z0-9_]*=")


def mask_secret(text: str, env: bool = False) -> str:
    """What a diff may show of a secret file: its comments and, of an environment file's
    (``env``) ``KEY=value`` lines, the key. Any other line (a PEM body, a map's value) may be
    the secret itself: a run of them shows as a count."""
    out, hidden = [], 0
    for line in text.splitlines():
        key = ENV_LINE.match(line) if env else None
        if key or line.lstrip().startswith("#") or not line.strip():
            if hidden:
                out.append(f"({hidden} secret line{'s' if hidden > 1 else ''})")
                hidden = 0
            out.append(f"{key.group(0)}{MASK}" if key else line)
        else:
            hidden += 1
    if hidden:
        out.append(f"({hidden} secret line{'s' if hidden > 1 else ''})")
    return "".join(line + "\n" for line in out)


WRITE_FILE = Path(__file__).parent / "host_scripts" / "write_file.sh"


def atomic_write_script(path: str, data: bytes, mode: str, owner: str, group: str, keep_previous: bool) -> str:
    """Write ``data`` to ``path`` so that no reader ever sees half a file (host_scripts/write_file.sh).

    The content travels base64-encoded inside a heredoc on the script's stdin,
    so a secret in it never reaches any command line. The new file is complete,
    with its final mode and owner, before ``mv`` puts it in place; the previous
    version is kept as ``PATH.previous`` (a hard link, so same mode).
    """
    return as_sent(WRITE_FILE) + write_file_call(path, data, mode, owner, group, keep_previous)


def write_file_call(path: str, data: bytes, mode: str, owner: str, group: str, keep_previous: bool) -> str:
    """The call of host_scripts/write_file.sh's ``write_file`` (its library defined before it) that
    writes ``data`` to ``path``: its content in base64, as the call's heredoc."""
    payload = base64.encodebytes(data).decode()
    call = " ".join(shlex.quote(str(a)) for a in ("write_file", path, mode, owner, group, int(keep_previous)))
    return f"{call} <<'__CONVERGE_EOF__'\n{payload}__CONVERGE_EOF__\n"


@dataclass(frozen=True)
class Transfer:
    """How far a long command has come: ``done`` of ``total`` (None: not known yet)
    in ``unit`` ("B" for bytes, or a count such as "layers")."""

    done: int
    total: int | None = None
    unit: str = "B"


@dataclass(frozen=True)
class Output(Generic[T]):
    """A value that a step produces when it runs, for the steps after it: declared
    by the step (``Command(produces=OUTPUT)``), read as ``ctx.results[OUTPUT]``.
    ``type`` is what the value must be (None is always allowed: "none to be had")."""

    name: str
    type: type


@dataclass
class Produced:
    """What the ``interpret`` of a step that produces a value returns."""

    value: object
    message: str = ""
    changed: bool | None = None  # None: as the step's ``changes`` says


class Results:
    """The values steps produced on one host so far. Only the runner records them
    (from `Produced`); a step that reads one its producer has not given fails
    with a message that names both."""

    def __init__(self):
        self._values: dict[str, object] = {}

    def __contains__(self, output: Output) -> bool:
        return output.name in self._values

    def __getitem__(self, output: Output[T]) -> T:
        if output.name not in self._values:
            raise StepFailed(f"{output.name} is not known: the step that produces it did not run before the step "
                             f"that needs it (a role's plan out of order)")
        return self._values[output.name]

    def get(self, output: Output[T], default=None) -> T | None:
        return self._values.get(output.name, default)

    def record(self, output: Output, value, by: str):
        if value is not None and not isinstance(value, output.type):
            raise StepFailed(f"{by} produced {type(value).__name__} for {output.name}, which holds "
                             f"{output.type.__name__}")
        self._values[output.name] = value


@dataclass(frozen=True)
class Throttle:
    """A run-wide limit on a kind of step: ``limit`` at once (0: no limit across hosts;
    a host runs its steps one after another anyway)."""

    name: str
    limit: int = 1


@dataclass
class Command(Step):
    """A command to run when ``when`` is true. ``describe`` is what check mode shows.

    ``interpret(result)`` may turn the result into a message (or raise StepFailed);
    for a step that ``produces`` a value it returns a `Produced`.
    """

    script: str = ""
    when: bool = True
    describe: str = ""
    timeout: float | None = 600
    # show the output as it comes; a function reads each line for how far the command
    # has come (a Transfer) or None; lines that start with "@" are markers, never shown
    progress: bool | Callable[[str], "Transfer | None"] = False
    interpret: Callable | None = None
    changes: bool = True  # False for read-only commands (waits, probes)
    # True when only running it can tell whether anything changes (e.g. asking a registry
    # whether a tag moved): check mode then reports it as skipped, not as a change
    maybe: bool = False
    # read-only and safe anywhere (e.g. asking a hub for a file list): it runs in check mode
    # too, so that what follows it can be planned and shown
    probe: bool = False
    # it runs on its own channel while the next roles that say `overlaps` go on (an image
    # pull beside a weights download); it is waited for before any other role
    background: bool = False
    produces: Output | None = None
    # what check mode and --diff show beside it (a file the command itself writes)
    diff: str = ""
    # at most ``throttle.limit`` steps of this name run at once in the whole run, across hosts
    # (Ansible's `throttle`); after one fails, the others are not started
    throttle: "Throttle | None" = None
    # handlers whose work this step does when it runs: they are not run again at the flush
    satisfies: tuple = ()

    def needed(self) -> bool:
        return self.when


@dataclass
class Decision(Step):
    """A value a role decides at plan time from facts and variables (a placement, a
    generation) and hands to the roles after it: the runner records it as ``produces``, as
    it records what a command produced, and the steps after it read ``ctx.results[OUTPUT]``.
    It changes nothing; a ``message`` is reported as a line of its own (none: no line)."""

    produces: Output | None = None
    value: object = None
    message: str = ""

    def needed(self) -> bool:
        return False


@dataclass
class Role:
    """What a role module provides to the engine."""

    name: str
    facts: Callable  # (vars) -> dict[str, Fact]
    plan: Callable  # (HostContext) -> iterable of Step
    handlers: Callable | None = None  # (HostContext) -> dict[name, Command]
    summary: Callable | None = None  # (HostContext) -> dict for the report (--json, tables)
    flush_handlers: bool = False  # run the handlers notified so far before this role (Ansible's flush_handlers)
    # which hosts it is for, by their variables (``group_names`` among them); None: every host
    hosts: Callable | None = None
    overlaps: bool = False  # may run while earlier roles' background steps still run


@dataclass
class HostContext:
    """What a role sees: the host's name, its variables, its facts, the values earlier
    steps produced or decided (``results``: typed, `Output`), the run's services as this
    host sees them (``services``: name -> object or None), which handlers were notified
    and which have run, and the steps that changed (or would, in check mode) so far."""

    name: str
    vars: dict
    facts: object
    results: Results = field(default_factory=Results)
    services: dict = field(default_factory=dict)
    handlers_run: set = field(default_factory=set)
    changed_steps: list = field(default_factory=list)
    check: bool = False
    # handlers notified so far and not yet run (the runner keeps it; a plan may read it)
    notified: list = field(default_factory=list)

    def pending(self, handler: str) -> bool:
        """Whether a step that ran has notified ``handler`` and it has not run yet."""
        return handler in self.notified and handler not in self.handlers_run
