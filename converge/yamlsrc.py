"""YAML loading that remembers where each key came from.

Error messages must name ``file:line`` for a key; PyYAML's composed nodes carry
marks, so we construct plain Python data ourselves and keep a map from key path
to line number alongside.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import yaml


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


class _Loader(yaml.SafeLoader):
    pass


def _construct(node, path: tuple, lines: dict, loader: _Loader):
    if isinstance(node, yaml.MappingNode):
        result = {}
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node, deep=True)
            if not isinstance(key, (str, int, float, bool)) and key is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"unhashable key {key!r}", key_node.start_mark)
            if key in result:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark)
            child = path + (key,)
            lines[child] = key_node.start_mark.line + 1
            result[key] = _construct(value_node, child, lines, loader)
        return result
    if isinstance(node, yaml.SequenceNode):
        items = []
        for index, item in enumerate(node.value):
            child = path + (index,)
            lines[child] = item.start_mark.line + 1
            items.append(_construct(item, child, lines, loader))
        return items
    return loader.construct_object(node, deep=True)


def load(path: str | Path) -> Sourced:
    """Read one YAML file; an empty file reads as an empty mapping.

    Raises ``yaml.YAMLError`` (with its mark) on a syntax error; callers turn it
    into an inventory error naming the file and line.
    """
    path = Path(path)
    text = path.read_text(encoding="utf-8")
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        lines: dict[tuple, int] = {(): 1}
        data = {} if node is None else _construct(node, (), lines, loader)
    finally:
        loader.dispose()
    return Sourced(path=path, data=data, lines=lines)
