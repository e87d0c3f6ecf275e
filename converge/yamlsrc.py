"""YAML loading that remembers where each key came from, within bounds.

Error messages must name ``file:line`` for a key; PyYAML's composed nodes carry
marks, so we construct plain Python data ourselves and keep a map from key path
to line number alongside. Whatever a file holds, loading it ends quickly with
data or with an ``InputError`` naming the line:
- a file is at most ``MAX_BYTES``; it is UTF-8 (a UTF-8 BOM is allowed);
- aliases are expanded, but a file yields at most ``MAX_VALUES`` values once
  expanded (a "billion laughs" alias bomb stops there) and nests at most
  ``MAX_DEPTH`` deep (a recursive alias stops there);
- merge keys (``<<: *defaults``) work as in Ansible, inside the same bounds.
"""
from __future__ import annotations

import codecs
from dataclasses import dataclass, field
from pathlib import Path

import yaml

MAX_BYTES = 1024 * 1024
MAX_VALUES = 100_000
MAX_DEPTH = 64
MERGE = "tag:yaml.org,2002:merge"


class InputError(Exception):
    """A file (or a value) that cannot be read; ``line`` is where, when known."""

    def __init__(self, message: str, line: int | None = None):
        self.message = message
        self.line = line
        super().__init__(message)


@dataclass
class Sourced:
    """Data read from one YAML file, and the line of every key path in it."""

    path: Path
    data: object
    lines: dict[tuple, int] = field(default_factory=dict)

    def line_of(self, keypath: tuple) -> int | None:
        """The line of the longest prefix of ``keypath`` that we know."""
        keypath = tuple(keypath)
        while keypath:
            if keypath in self.lines:
                return self.lines[keypath]
            keypath = keypath[:-1]
        return self.lines.get((), 1)


# libyaml's parser where PyYAML was built with it (the wheels are): the same nodes and marks,
# and no quadratic scan of a long flow sequence, which the pure-Python scanner has
class _Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    pass


def decode(raw: bytes) -> str:
    """UTF-8 text, or an InputError saying which line holds what is not."""
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if raw.startswith(bom):
            raise InputError(f"the file is {name} text (it starts with a {name} byte order mark): save it as UTF-8", 1)
    raw = raw.removeprefix(codecs.BOM_UTF8)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        column = exc.start - (raw.rfind(b"\n", 0, exc.start) + 1) + 1
        raise InputError(f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {column}): save the file as UTF-8",
                         line) from None


def read(path: str | Path, limit: int = MAX_BYTES) -> str:
    """A text file, refused beyond ``limit`` bytes or when it is not UTF-8."""
    with open(path, "rb") as handle:
        raw = handle.read(limit + 1)
    if len(raw) > limit:
        raise InputError(f"larger than {limit // 1024} KiB: is this the right file?", 1)
    return decode(raw)


class _Builder:
    """Plain data from composed nodes, counting every value made (aliases expanded)."""

    def __init__(self, loader: _Loader):
        self.loader = loader
        self.lines: dict[tuple, int] = {(): 1}
        self.count = 0

    def _spend(self, node, depth: int):
        self.count += 1
        if self.count > MAX_VALUES:
            raise InputError(f"more than {MAX_VALUES} values once its aliases are expanded (an alias bomb?): "
                             f"write the values out", node.start_mark.line + 1)
        if depth > MAX_DEPTH:
            raise InputError(f"nested more than {MAX_DEPTH} deep (an alias that contains itself?)",
                             node.start_mark.line + 1)

    def build(self, node, path: tuple = (), depth: int = 0):
        self._spend(node, depth)
        if isinstance(node, yaml.MappingNode):
            return self._mapping(node, path, depth)
        if isinstance(node, yaml.SequenceNode):
            items = []
            for index, item in enumerate(node.value):
                child = path + (index,)
                self.lines[child] = item.start_mark.line + 1
                items.append(self.build(item, child, depth + 1))
            return items
        return self.loader.construct_object(node, deep=True)

    def _mapping(self, node, path: tuple, depth: int) -> dict:
        result: dict = {}
        merged: list = []
        for key_node, value_node in node.value:
            if key_node.tag == MERGE:
                merged.append(value_node)
                continue
            if not isinstance(key_node, yaml.ScalarNode):
                raise InputError("a key must be a plain value (not a list or a mapping)", key_node.start_mark.line + 1)
            key = self.loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise InputError(f"a key must be a plain value, not {type(key).__name__}", key_node.start_mark.line + 1)
            if key in result:
                raise InputError(f"duplicate key {key!r}: YAML keeps only one of them; remove the other",
                                 key_node.start_mark.line + 1)
            child = path + (key,)
            self.lines[child] = key_node.start_mark.line + 1
            result[key] = self.build(value_node, child, depth + 1)
        # `<<: *a` or `<<: [*a, *b]`: keys written here win, then the first merged mapping
        for source in merged:
            sources = source.value if isinstance(source, yaml.SequenceNode) else [source]
            for mapping in sources:
                if not isinstance(mapping, yaml.MappingNode):
                    raise InputError("a merge key (<<) takes a mapping or a list of mappings",
                                     mapping.start_mark.line + 1)
                self._spend(mapping, depth + 1)
                for key, value in self._mapping(mapping, path, depth + 1).items():
                    result.setdefault(key, value)
                    self.lines.setdefault(path + (key,), mapping.start_mark.line + 1)
        return result


def load_text(text: str, path: str | Path = "<text>") -> Sourced:
    """Parse YAML text within the bounds; raises InputError or yaml.YAMLError (with its mark)."""
    loader = _Loader(text)
    try:
        try:
            node = loader.get_single_node()
        except RecursionError:
            raise InputError(f"nested too deep to read (more than {MAX_DEPTH} levels are refused anyway)") from None
        builder = _Builder(loader)
        data = {} if node is None else builder.build(node)
    finally:
        loader.dispose()
    return Sourced(path=Path(path), data=data, lines=builder.lines if node is not None else {(): 1})


def load(path: str | Path) -> Sourced:
    """Read one YAML file; an empty file reads as an empty mapping.

    Raises ``InputError`` (size, encoding, bounds) or ``yaml.YAMLError`` (with
    its mark) on a syntax error; callers turn either into a message naming the
    file and line."""
    return load_text(read(path), path)
