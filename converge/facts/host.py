"""Facts about the host itself: arch, OS, memory, disk, systemd, files, units."""
from __future__ import annotations

import base64
import hashlib
import re

from . import LIBRARIES, Batch, Fact, FactError, call

LIBRARY = LIBRARIES / "host.sh"
# what files/host.sh prints, a marker a line, and what follows each (read by the facts below)
MARKERS = {"file": "PATH: a file's text follows, in base64", "unit": "PATH: a unit file's state follows",
           "state": "its unit's state follows (systemctl show); with MODE OWNER GROUP SIZE PATH: a file's",
           "one": "PATH: a link's state follows, as fact_file_state prints it", "one-end": "the link's state ends",
           "hashes": "sha256sum's lines follow", "content": "the files' bytes follow, in base64"}
# a path that a batch of file states may name (its stat and sha256sum lines read back plainly)
PLAIN_PATH = re.compile(r"/[A-Za-z0-9_./@:+=-]+")


class Arch(Fact):
    library, command = LIBRARY, "fact_arch"

    def process(self, output, rc):
        return output.strip()


def parse_os_release(text: str) -> dict:
    out = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            key, _, value = line.partition("=")
            out[key.strip()] = value.strip().strip('"').strip("'")
    return out


class OsRelease(Fact):
    library, command = LIBRARY, "fact_os_release"

    def process(self, output, rc):
        return parse_os_release(output)


def parse_meminfo(text: str) -> dict:
    """``/proc/meminfo`` in MiB: MemTotal, MemAvailable, ..."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            kib = int(fields[0])
            out[key.strip()] = kib / 1024 if (len(fields) > 1 and fields[1] == "kB") else kib
    return out


class MemInfo(Fact):
    library, command = LIBRARY, "fact_meminfo"

    def process(self, output, rc):
        info = parse_meminfo(output)
        if "MemAvailable" not in info:
            raise FactError("/proc/meminfo has no MemAvailable (kernel older than 3.14?)")
        return info


class DiskFree(Fact):
    """Free space (MiB) where ``path`` is or would be created (its nearest existing parent)."""

    def __init__(self, path: str):
        self.path = path
        self.library, self.command = LIBRARY, call("fact_disk_free", path)

    def process(self, output, rc):
        fields = output.split()
        if rc != 0 or len(fields) < 6:
            raise FactError(f"df failed for {self.path}: {output.strip()}")
        return {"path": self.path, "mount": fields[5], "free_mib": int(fields[3]) // 1024}


class Directory(Fact):
    """Whether ``path`` is a directory."""

    def __init__(self, path: str):
        self.path = path
        self.library, self.command = LIBRARY, call("fact_directory", path)

    def process(self, output, rc):
        return output.strip() == "yes"


class Systemd(Fact):
    library, command = LIBRARY, "fact_systemd"

    def process(self, output, rc):
        lines = output.splitlines()
        if not lines or not lines[0].startswith("running"):
            return {"present": False}
        version = lines[0].split()
        return {"present": True, "version": int(version[2]) if len(version) > 2 and version[2].isdigit() else None,
                "state": lines[1].strip() if len(lines) > 1 else "unknown"}


class Commands(Fact):
    """Which of the named commands exist, and where."""

    def __init__(self, *names):
        self.names = names
        self.library, self.command = LIBRARY, call("fact_commands", *names)

    def process(self, output, rc):
        found = {}
        for line in output.splitlines():
            name, _, path = line.partition(" ")
            found[name] = None if path in ("-", "") else path
        return found


class FileState(Fact):
    """A file's mode, owner, size, sha256 and (unless ``secret``) its content.

    A secret file's content never leaves the host; its hash says enough. Two
    small programs per file (stat, then sha256sum for a secret, base64 for the
    rest, whose hash is taken here from the bytes sent): on a fleet that shares
    a machine, forks are most of what a no-op run costs the hosts (a tenth of a
    second each on the lab's emulated spark01).
    """

    def __init__(self, path: str, secret: bool = False):
        self.path = path
        self.secret = secret
        self.library, self.command = LIBRARY, call("fact_file_state", path, "secret" if secret else "")

    def batch(self):
        # fifteen files of a deploy: one stat, one cat and one base64 (or sha256sum), not thirty programs
        return FILE_STATES[self.secret] if PLAIN_PATH.fullmatch(self.path) else None

    def process(self, output, rc):
        lines = output.splitlines()
        if not lines or lines[0] == "absent":
            return None
        mode, owner, group, size = lines[0].split()
        state = {"mode": mode.rjust(4, "0"), "owner": owner, "group": group, "size": int(size)}
        if self.secret:
            state["sha256"] = lines[1].split()[0] if len(lines) > 1 else ""
        else:
            data = base64.b64decode("".join(lines[1:]))
            state["sha256"] = hashlib.sha256(data).hexdigest()
            state["content"] = data.decode("utf-8", "replace")
        return state


def _file_states_command(members: list) -> str:
    return call("fact_file_states", "secret" if members[0].secret else "", *(m.path for m in members))


def _file_states_split(output: str, rc: int, members: list) -> list:
    """Each file's answer as fact_file_state prints it, from fact_file_states' one answer."""
    lines, found, n = output.split("\n"), {}, 0
    states: list[tuple[str, list]] = []
    while n < len(lines):
        line = lines[n]
        if line.startswith("@one "):
            if "@one-end" not in lines[n:]:
                raise FactError(f"a link's state came without its end: {output.strip()[-200:]!r}")
            end = lines.index("@one-end", n)
            found[line[5:]] = "\n".join(lines[n + 1:end])
            n = end + 1
        elif line.startswith("@state "):
            fields = line.split(" ", 5)
            states.append((fields[5], fields[1:5]))
            n += 1
        else:
            break
    body = lines[n + 1:] if n < len(lines) else []
    if states and not lines[n:n + 1] == ["@hashes" if members[0].secret else "@content"]:
        raise FactError(f"the files' states came without their contents: {output.strip()[-200:]!r}")
    if members[0].secret:
        hashes = dict(reversed(line.split("  ", 1)) for line in body if "  " in line)
        for path, meta in states:
            found[path] = " ".join(meta) + "\n" + hashes.get(path, "")
    else:
        data = base64.b64decode("".join(body))
        if sum(int(meta[3]) for _, meta in states) != len(data):
            raise FactError("files changed while they were read (their sizes and bytes disagree): run again")
        at = 0
        for path, meta in states:
            size = int(meta[3])
            found[path] = " ".join(meta) + "\n" + base64.b64encode(data[at:at + size]).decode()
            at += size
    return [(found.get(m.path, "absent"), 0) for m in members]


FILE_STATES = {secret: Batch(("file_state", secret), LIBRARY, _file_states_command, _file_states_split)
               for secret in (False, True)}


class UnitState(Fact):
    """A systemd unit's load, active and enabled state, and when it entered it."""

    def __init__(self, unit: str):
        self.unit = unit
        self.library, self.command = LIBRARY, call("fact_unit_state", unit)

    def batch(self):
        return UNIT_STATES  # the units of a deploy: one systemctl show for them all

    def process(self, output, rc):
        props = {}
        for line in output.splitlines():
            key, sep, value = line.partition("=")
            if sep:
                props[key] = value
        if not props:
            raise FactError(f"systemctl show {self.unit} printed nothing: is systemd running?")
        return props


def _unit_states_split(output: str, rc: int, members: list) -> list:
    """Each unit's block of one ``systemctl show`` of them all (a blank line between blocks)."""
    blocks = [block for block in re.split(r"\n\s*\n", output.strip("\n")) if block.strip()]
    if len(blocks) != len(members):
        raise FactError(f"systemctl show answered {len(blocks)} of {len(members)} units: is systemd running? "
                        f"{output.strip()[:200]!r}")
    return [(block, rc) for block in blocks]


UNIT_STATES = Batch(("unit_state",), LIBRARY, lambda members: call("fact_unit_state", *(m.unit for m in members)),
                    _unit_states_split)


def plain_globs(patterns: tuple) -> str:
    """Shell globs, checked to be globs alone (no quote, expansion, separator or blank)."""
    for pattern in patterns:
        if not pattern or any(c in pattern for c in "'\"`$;&|<>\n "):
            raise ValueError(f"not a plain glob: {pattern!r}")
    return " ".join(patterns)


class TextFiles(Fact):
    """The text of the files shell globs name (e.g. /etc/nixos/*.nix), each cut
    at ``max_bytes``: ``{path: text}``, empty when none match."""

    def __init__(self, *patterns: str, max_bytes: int = 256 * 1024):
        pattern = plain_globs(patterns)
        self.pattern = pattern
        self.library, self.command = LIBRARY, call("fact_text_files", int(max_bytes), *patterns)

    def process(self, output, rc):
        files: dict[str, list[str]] = {}
        current = None
        for line in output.splitlines():
            if line.startswith("@file "):
                current = line[6:]
                files[current] = []
            elif current is not None:
                files[current].append(line)
        return {path: base64.b64decode("".join(lines)).decode("utf-8", "replace") for path, lines in files.items()}


class HttpHeader(Fact):
    """One response header of ``url`` as the host itself sees it (None when nothing
    answers, or the header is absent). The host asks itself: its certificate is not
    what this fact is about, so it is not checked here.

    A refused connection is an answer at once; only a timeout (curl's exit 28) is asked
    again, ``TRIES`` times 2 s: a busy host that takes more than 2 s to answer once is not
    a server that does not answer (the front door's role restarts one that does not)."""

    TRIES = 3

    def __init__(self, url: str, header: str):
        self.header = header.lower()
        self.library, self.command = LIBRARY, call("fact_http_headers", url, self.TRIES)

    def process(self, output, rc):
        for line in output.splitlines():
            name, sep, value = line.partition(":")
            if sep and name.strip().lower() == self.header:
                return value.strip()
        return None


class UnitFiles(Fact):
    """The unit files shell globs name (e.g. /etc/systemd/system/foo-[0-9]*.service),
    each with its FileState and its UnitState: ``{path: {"file": ..., "state": ...}}``,
    empty when none match. For a family of units whose members are not known in advance."""

    def __init__(self, *patterns: str):
        pattern = plain_globs(patterns)
        self.pattern = pattern
        self.library, self.command = LIBRARY, call("fact_unit_files", *patterns)

    def process(self, output, rc):
        found: dict[str, dict] = {}
        path, part, chunks = None, None, {}
        for line in output.splitlines() + ["@unit"]:
            if line.startswith("@unit"):
                if path is not None:
                    found[path] = {"file": FileState(path).process("\n".join(chunks["file"]), 0),
                                   "state": UnitState(path).process("\n".join(chunks["state"]), 0)}
                path, part, chunks = line[6:], "file", {"file": [], "state": []}
            elif line == "@state" and path is not None:
                part = "state"
            elif path is not None:
                chunks[part].append(line)
        return found
