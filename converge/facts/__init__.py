"""Facts: a shell command and a pure ``process(output, rc)``.

All facts a host needs are gathered in one script, so one round trip. Each fact's
output is framed by a random boundary, so no output can be mistaken for another
fact's.

The facts run side by side, each in a subshell of its own writing to a file of a
private temporary folder, and the files are printed in order once every fact has
ended. Most facts are a few small programs, and a host that starts programs
slowly (an emulated one, or one whose container CLIs take most of a second each)
waited for them one after another: on the lab's aarch64 host under qemu, 13.6 s
one by one, 9.3 s side by side. Where no temporary folder can be made (a full or
read-only /tmp), they run one after another, straight to the output, as before.

A fact whose command is more than a word or two calls a function of a library of shell
functions (``files/*.sh``, its ``library``); the gathering sends each library once, before
the facts, so that a host with 40 file facts is not sent 40 copies of one program.

Facts of one kind that one program answers for many (a file's state, a unit's: `Batch`) run as
one command: fifteen files cost a `stat`, a `cat` and a `base64`, not thirty programs, and four
units one `systemctl show`. Each answer is cut back into the output the fact would have printed
alone, so its ``process`` is the same either way.
"""
from __future__ import annotations

import secrets
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..shell_files import as_sent

LIBRARIES = Path(__file__).parent / "files"


class FactError(Exception):
    """A fact could not be read; the message says why and what to do."""


class Fact:
    """Subclasses set ``command`` (a shell snippet, or a `call` of a function of their
    ``library``, a file of shell functions) and implement ``process``."""

    command: str = "true"
    library: Path | None = None

    def standalone(self) -> str:
        """The fact's command with its library before it: the fact run on its own."""
        return (as_sent(self.library) if self.library else "") + self.command + "\n"

    def process(self, output: str, rc: int):
        raise NotImplementedError

    def batch(self) -> "Batch | None":
        """The batch that answers this fact together with others of its kind (None: alone)."""
        return None


@dataclass(frozen=True)
class Batch:
    """Facts one program answers together: ``key`` says which facts may share it (equal keys,
    one batch), ``command(members)`` is that program's call for them (a function of ``library``),
    and ``split(output, rc, members)`` cuts its output into each member's (output, rc), as the
    member's own command would have printed it (a `FactError`: none of them could be read)."""

    key: tuple
    library: Path
    command: Callable[[list], str]
    split: Callable[[str, int, list], list]


def call(function: str, *args) -> str:
    """A fact's command: ``function`` of its library, with ``args``, each quoted."""
    return " ".join((function, *(shlex.quote(str(a)) for a in args)))


@dataclass
class Facts:
    values: dict = field(default_factory=dict)
    errors: dict = field(default_factory=dict)

    def __getitem__(self, name):
        if name in self.errors:
            raise FactError(self.errors[name])
        return self.values[name]

    def get(self, name, default=None):
        return self.values.get(name, default)


GATHER = Path(__file__).parent.parent / "host_scripts" / "gather.sh"


def asked_first(facts: dict[str, Fact]) -> dict[str, str]:
    """Each fact's name -> the name of the first fact that runs the same command: that one runs,
    once, and answers for both (two roles asking the same thing of a host, such as the front door
    and the gateway each asking what answers on its port, cost one program, not two: a second of
    CPU each on an emulated host)."""
    first: dict[tuple, str] = {}
    return {name: first.setdefault((fact.library, fact.command), name) for name, fact in facts.items()}


def batched(facts: dict[str, Fact]) -> tuple[dict[str, Fact], dict[str, tuple[Batch, dict[str, Fact]]]]:
    """The facts that run alone, and each batch of two or more facts (a name of its own, which
    no fact's name can be: ``+N``) with its members by name, in the order they were asked."""
    groups: dict[tuple, tuple[Batch, dict[str, Fact]]] = {}
    for name, fact in facts.items():
        batch = fact.batch()
        if batch is not None:
            groups.setdefault(batch.key, (batch, {}))[1][name] = fact
    shared = [group for group in groups.values() if len(group[1]) > 1]
    inside = {name for _, members in shared for name in members}
    alone = {name: fact for name, fact in facts.items() if name not in inside}
    return alone, {f"+{n}": (batch, members) for n, (batch, members) in enumerate(shared)}


def _first_askers(facts: dict[str, Fact], firsts: dict[str, str]) -> dict[str, Fact]:
    """The facts whose commands run: of two that share one, the first (``firsts``: `asked_first`)."""
    return {name: facts[name] for name, first in firsts.items() if name == first}


def script(facts: dict[str, Fact], boundary: str) -> str:
    """The facts' libraries (each once), a function per fact (``_fact_N``: its command) or batch
    of facts (its one command for them all), then host_scripts/gather.sh, which runs them and
    frames what each prints. A command that two facts share runs once (``asked_first``), under
    the first one's name."""
    return _script(*batched(_first_askers(facts, asked_first(facts))), boundary)


def _script(alone: dict[str, Fact], batches: dict[str, tuple[Batch, dict[str, Fact]]], boundary: str) -> str:
    commands = {name: (fact.library, fact.command) for name, fact in alone.items()}
    commands.update({name: (batch.library, batch.command(list(members.values())))
                     for name, (batch, members) in batches.items()})
    libraries = dict.fromkeys(library for library, _ in commands.values() if library is not None)
    functions = "".join(f"_fact_{n}() {{\n{command}\n}}\n" for n, (_, command) in enumerate(commands.values()))
    return (f"BOUNDARY={shlex.quote(boundary)}\nNAMES={shlex.quote(' '.join(commands))}\n"
            + "".join(as_sent(path) for path in libraries) + functions + as_sent(GATHER))


def unbatch(batches: dict[str, tuple[Batch, dict[str, Fact]]],
            raw: dict[str, tuple[str, int]]) -> dict[str, tuple[str, int]]:
    """``raw`` with each batch's answer cut into its members' (a batch that could not be read:
    each member's error, as a `FactError` text in place of an output, and rc None)."""
    found = {name: answer for name, answer in raw.items() if name not in batches}
    for name, (batch, members) in batches.items():
        if name not in raw:
            continue
        output, rc = raw[name]
        try:
            parts = batch.split(output, rc, list(members.values()))
            if len(parts) != len(members):
                raise FactError(f"one program answered {len(parts)} of these facts for {len(members)} asked: "
                                f"{output.strip()[:200]!r}")
        except FactError as exc:
            parts = [(str(exc), None)] * len(members)
        except Exception as exc:  # noqa: BLE001 - whatever a host prints must fail those facts, not the run
            parts = [(f"could not read the answer of facts {', '.join(members)} ({type(exc).__name__}: "
                      f"{str(exc)[:200]}): {output.strip()[:200]!r}", None)] * len(members)
        found.update(zip(members, parts))
    return found


def split(output: str, boundary: str) -> dict[str, tuple[str, int]]:
    """Cut the gathered output back into ``name -> (output, rc)``."""
    found: dict[str, tuple[str, int]] = {}
    current, lines = None, []
    for line in output.split("\n"):
        if line.startswith(boundary + " "):
            _, kind, *rest = line.split(" ")
            if kind == "begin":
                current, lines = rest[0], []
            elif kind == "end" and current == rest[0]:
                text = "\n".join(lines)
                found[current] = (text[:-1] if text.endswith("\n") else text, int(rest[1]))
                current = None
        elif current is not None:
            lines.append(line)
    return found


def process_all(facts: dict[str, Fact], raw: dict[str, tuple[str, int]]) -> Facts:
    result = Facts()
    for name, fact in facts.items():
        if name not in raw:
            result.errors[name] = "gathering stopped before this fact answered"
            continue
        output, rc = raw[name]
        if rc is None:  # its batch could not be read (unbatch): the output says why
            result.errors[name] = output
            continue
        try:
            result.values[name] = fact.process(output, rc)
        except FactError as exc:
            result.errors[name] = str(exc)
        except Exception as exc:  # noqa: BLE001 - whatever a host prints must fail that fact, not the run
            # a parser meeting output it does not know: say so, with the output, per host
            result.errors[name] = (f"could not read the output of fact {name!r} ({type(exc).__name__}: "
                                   f"{str(exc)[:200]}): {output.strip()[:200]!r}")
    return result


class Gathering:
    """One host's facts as one script: run ``script`` (alone, or after other
    shell such as a lock), read its output up to the line ``done``, ``parse`` it."""

    def __init__(self, facts: dict[str, Fact]):
        self.facts = facts
        self.boundary = "@@fact-" + secrets.token_hex(8)
        self.done = f"{self.boundary} done"
        self.asked_first = asked_first(facts)
        alone, self.batches = batched(_first_askers(facts, self.asked_first))
        self.script = _script(alone, self.batches, self.boundary)  # it ends with the line ``done``

    def parse(self, output: str) -> Facts:
        raw = unbatch(self.batches, split(output, self.boundary))
        shared = {name: raw[first] for name, first in self.asked_first.items() if first in raw}
        return process_all(self.facts, shared)


def gather(connection, facts: dict[str, Fact], timeout: float = 120) -> Facts:
    """Run every fact on the host in one script and process each answer."""
    gathering = Gathering(facts)
    return gathering.parse(connection.run(gathering.script, timeout=timeout).stdout)
