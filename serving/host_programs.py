"""Programs that run on a host, kept as shell files (``roles/<role>/files/*.sh``) and
the protocol each speaks back: the markers it prints (a line ``@name fields...``) and
the exit codes it ends with, declared once here for the script and its reader alike.

A program is its files in order (libraries first), with its parameters set before them
as shell variables (every value quoted; each schema-checked where it comes from the
inventory) and its exit codes as ``EXIT_<NAME>`` variables, sent to the host's ``sh``
on its standard input. ``grouped`` wraps it in ``{ }``: sh reads all of it before it
runs any of it, so one cut short on its way (a link lost mid-send) runs nothing.

A reader asks for a marker through its protocol (`Protocol.first`, `every`, `rest`),
which refuses a marker the protocol does not declare; the unit tests check that every
marker a program's files can print is declared, and read: taking its lines out of an
output changes what the reader says.

A program that answers with data ends with one result line, ``@result {JSON object}``,
whose fields its protocol declares (``result``); `Protocol.result` reads it, and refuses
an output without it or with other fields (`ProgramResultError`, which names the program
and what was wrong). Text a host program cannot quote as JSON (a page it read, a file) is
a field in base64 (`decoded`). Pure."""
from __future__ import annotations

import base64
import binascii
import json
import re
import shlex
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

# what a program's files print as a marker: say "@name", echo "@name", echo '@name', printf '@name',
# awk's print "@name", sed's s/^/@name (each line of a file marked)
PRINTED = re.compile(r"""(?:\b(?:say|echo|printf|print)\s+["']\\?n?@|\bs/\^/@)([a-z][a-z-]*)""")


class ProgramResultError(ValueError):
    """A program's result line is missing or not what its protocol declares."""


RESULT = "result"  # the marker of a program's result line


@dataclass(frozen=True)
class Protocol:
    """What a program tells its reader: markers (name -> what follows it), exit codes, and
    the fields of its result line (name -> what it holds; none: the program has no result)."""
    name: str
    markers: dict = field(default_factory=dict)
    exits: dict = field(default_factory=dict)  # name -> code (0 is success, never declared)
    result: dict = field(default_factory=dict)

    def declared(self) -> set[str]:
        """Every marker the program may print: its markers, and @result when it has one."""
        return set(self.markers) | ({RESULT} if self.result else set())

    def _known(self, marker: str) -> str:
        if marker not in self.markers:
            raise KeyError(f"{self.name} declares no marker @{marker}")
        return marker

    def result_of(self, out: str) -> dict:
        """The program's result: the JSON object of its last ``@result`` line, with exactly
        the fields the protocol declares."""
        if not self.result:
            raise KeyError(f"{self.name} declares no result")
        lines = re.findall(r"^@result (.*)$", out, re.M)
        if not lines:
            tail = out.strip()[-200:]
            raise ProgramResultError(f"{self.name}: no result line (it printed {tail!r})" if tail else
                                     f"{self.name}: no result line (it printed nothing)")
        try:
            found = json.loads(lines[-1])
        except ValueError as exc:
            raise ProgramResultError(f"{self.name}: its result is not JSON ({exc}): {lines[-1][:200]!r}") from None
        if not isinstance(found, dict) or set(found) != set(self.result):
            got = sorted(found) if isinstance(found, dict) else type(found).__name__
            raise ProgramResultError(f"{self.name}: its result has {got}, not the fields "
                                     f"{sorted(self.result)} it declares")
        return found

    def _lines(self, out: str, marker: str):
        return re.finditer(rf"^@{re.escape(self._known(marker))}(?: (.*))?$", out, re.M)

    def first(self, out: str, marker: str) -> list[str] | None:
        """The fields of the first ``@marker`` line, or None when there is none."""
        found = next(self._lines(out, marker), None)
        return None if found is None else (found.group(1) or "").split()

    def every(self, out: str, marker: str) -> list[list[str]]:
        return [(m.group(1) or "").split() for m in self._lines(out, marker)]

    def rest(self, out: str, marker: str, skip: int = 0) -> str | None:
        """The text after the first ``@marker`` and ``skip`` fields (a reason, with its blanks)."""
        found = next(self._lines(out, marker), None)
        if found is None:
            return None
        return (found.group(1) or "").split(" ", skip)[skip] if skip else (found.group(1) or "")

    def exit(self, name: str) -> int:
        return self.exits[name]

    def header(self) -> str:
        return "".join(f"EXIT_{name.upper()}={code}\n" for name, code in self.exits.items())


def ended(protocol: Protocol, result, unit: str) -> tuple[dict, str]:
    """How a program that waits for ``unit`` ended: its result (a StepFailed naming the unit and
    the exit status when it has none), and the log lines it printed before it (``  | ``)."""
    from converge.errors import StepFailed
    try:
        said = protocol.result_of(result.stdout)
    except ProgramResultError as exc:
        raise StepFailed(f"{unit}: exit {result.rc}: {exc}") from None
    return said, "\n".join(line for line in result.stdout.splitlines() if line.startswith("  | "))


def decoded(field_value: str, what: str = "a field") -> str:
    """A result field a program wrote in base64 (``base64 -w0``), as text."""
    try:
        return base64.b64decode(field_value or "", validate=True).decode("utf-8", "replace")
    except (binascii.Error, ValueError):
        raise ProgramResultError(f"{what} is not base64: {str(field_value)[:80]!r}") from None


# the library that reads a NAME=VALUE table's rows by name (a program that is handed one includes it first)
NAME_VALUE_TABLE = Path(__file__).parent / "files" / "name_value_table.sh"
# the library that prints a program's result line (`result NAME=VALUE...`)
RESULT_LIBRARY = Path(__file__).parent / "files" / "result.sh"


@lru_cache(maxsize=None)
def _read(path: Path) -> str:
    return path.read_text()


@dataclass(frozen=True)
class Program:
    """Shell files that make one program on the host, in order, and its protocol."""
    files: tuple  # Path
    protocol: Protocol | None = None

    def text(self) -> str:
        return "".join(_read(path) for path in self.files)

    def script(self, params: dict, before: str = "", grouped: bool = False) -> str:
        """The program with ``params`` (name -> value, quoted here) set before it, and ``before``
        (generated shell: functions made from data, such as a file to write) after them."""
        settings = "".join(f"{name}={shlex.quote(str(value))}\n" for name, value in params.items())
        body = settings + (self.protocol.header() if self.protocol else "") + before + self.text()
        return f"{{\n{body}}}\n" if grouped else body

    def printed_markers(self) -> set[str]:
        """Every marker the program's files can print."""
        return {m for path in self.files for m in PRINTED.findall(_read(path))}
