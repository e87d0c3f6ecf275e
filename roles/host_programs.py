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
output changes what the reader says. Pure."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

# what a program's files print as a marker: say "@name", echo "@name", echo '@name', printf '@name',
# awk's print "@name"
PRINTED = re.compile(r"""\b(?:say|echo|printf|print)\s+["']\\?n?@([a-z][a-z-]*)""")


@dataclass(frozen=True)
class Protocol:
    """What a program tells its reader: markers (name -> what follows it) and exit codes."""
    name: str
    markers: dict = field(default_factory=dict)
    exits: dict = field(default_factory=dict)  # name -> code (0 is success, never declared)

    def _known(self, marker: str) -> str:
        if marker not in self.markers:
            raise KeyError(f"{self.name} declares no marker @{marker}")
        return marker

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
