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
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field


class FactError(Exception):
    """A fact could not be read; the message says why and what to do."""


class Fact:
    """Subclasses set ``command`` (a shell snippet) and implement ``process``."""

    command: str = "true"

    def process(self, output: str, rc: int):
        raise NotImplementedError


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


def script(facts: dict[str, Fact], boundary: str) -> str:
    parts = ["exec 2>&1", "LC_ALL=C; export LC_ALL"]
    names = list(facts)
    for number, name in enumerate(names):
        # a function per fact, framed by its markers; a subshell so that one fact's `exit`
        # or `set -e` cannot end the others
        parts.append(f"_fact{number}() {{\nprintf '%s begin {name}\\n' {boundary}\n( {facts[name].command}\n) </dev/null\n"
                     f"printf '\\n%s end {name} %s\\n' {boundary} $?\n}}")
    side_by_side = " ".join(f'_fact{n} >"$_facts/{n}" 2>&1 </dev/null &' for n in range(len(names)))
    files = " ".join(f'"$_facts/{n}"' for n in range(len(names)))
    one_by_one = "; ".join(f"_fact{n}" for n in range(len(names))) or ":"
    # the folder goes with the subshell, however it ends (a lost link: its `cat` gets SIGPIPE)
    parts.append(f"if _facts=$(mktemp -d 2>/dev/null); then (\n"
                 f"trap 'rm -rf \"$_facts\"' EXIT; trap 'exit 1' HUP INT TERM PIPE\n"
                 f"{side_by_side or ':'}\nwait\n{'cat ' + files if names else ':'}\n)\nelse {one_by_one}; fi")
    return "\n".join(parts) + "\n"


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
        self.script = script(facts, self.boundary) + f"printf '%s done\\n' {self.boundary}\n"

    def parse(self, output: str) -> Facts:
        return process_all(self.facts, split(output, self.boundary))


def gather(connection, facts: dict[str, Fact], timeout: float = 120) -> Facts:
    """Run every fact on the host in one script and process each answer."""
    gathering = Gathering(facts)
    return gathering.parse(connection.run(gathering.script, timeout=timeout).stdout)
