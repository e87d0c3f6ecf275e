"""Writing one variable into an inventory file as a person would: the line that sets it changed in
place (its comment kept), or a line added at the end; every other line as it was. The file is
read back and must say what was meant, every other variable unchanged, before it replaces the
old one (atomically, with its mode). Which file: the host's own (``host_vars``) or a group's
(``group_vars``), where that name already sets the variable, else its first file, else a new
``host_vars/NAME.yml`` / ``group_vars/NAME.yml``."""
from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path

import yaml

from . import yamlsrc
from .errors import InventoryError

# a top-level key of a block mapping, and what follows it on its line: its value, then a comment
TOP_KEY = re.compile(r"^(?P<key>[A-Za-z_][\w.-]*)(?P<sep>\s*:\s*)(?P<value>.*?)(?P<comment>\s+#.*)?$")


def yaml_scalar(value) -> str:
    """A number, boolean, null or string as one YAML scalar (JSON's spelling is YAML's)."""
    if isinstance(value, (bool, int, float)) or value is None:
        return json.dumps(value)
    return json.dumps(str(value))


def with_value(text: str, key: str, value, where: str) -> str:
    """``text`` (a YAML mapping) with the top-level ``key`` set to ``value``."""
    lines = text.splitlines(keepends=True)
    scalar = yaml_scalar(value)
    for i, line in enumerate(lines):
        found = TOP_KEY.match(line.rstrip("\n"))
        if not found or found["key"] != key:
            continue
        if found["value"].strip() in ("", "|", ">") or found["value"].strip().startswith(("&", "*", "!")):
            raise InventoryError([f"{where}:{i + 1}: {key} is not written as a plain value on its line; set it "
                                  f"to {scalar} by hand"])
        ending = "\n" if line.endswith("\n") else ""
        lines[i] = f"{found['key']}{found['sep']}{scalar}{found['comment'] or ''}{ending}"
        return "".join(lines)
    body = "".join(lines)
    if body and not body.endswith("\n"):
        body += "\n"
    return f"{body}{key}: {scalar}\n"


def set_variable(path: Path, key: str, value) -> tuple[str, str]:
    """Set ``key`` to ``value`` in the inventory file ``path`` (made when absent). Returns the text
    before and after. Refuses a file that is not a mapping of variables, or where the change would
    mean anything else (read back: ``key`` is ``value``, the rest as it was)."""
    where = str(path)
    before = path.read_text() if path.exists() else ""
    try:
        old = yaml.safe_load(before) if before.strip() else {}
    except yaml.YAMLError as exc:
        raise InventoryError([f"{where}: not YAML ({exc}); mend it first"]) from None
    if old is None:
        old = {}
    if not isinstance(old, dict):
        raise InventoryError([f"{where}:1: not a mapping of variables; mend it first"])
    if before.lstrip().startswith("{"):
        raise InventoryError([f"{where}:1: written as one flow mapping ({{...}}); set {key}: {yaml_scalar(value)} "
                              f"by hand"])
    after = with_value(before, key, value, where)
    try:
        new = yamlsrc.load_text(after, path).data
    except (yamlsrc.InputError, yaml.YAMLError) as exc:
        raise InventoryError([f"{where}: writing {key} would break the file ({getattr(exc, 'message', exc)}); nothing was written"]) \
            from None
    if new != {**old, key: value}:
        raise InventoryError([f"{where}: writing {key} would change more than {key}; nothing was written. Set it "
                              f"by hand"])
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o644
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(after)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return before, after


def file_for(inventory, kind: str, name: str, key: str) -> Path:
    """The file of ``kind`` (``host_vars`` or ``group_vars``) for ``name`` to set ``key`` in: the one
    of that name that sets it now, else the first of that name, else ``KIND/NAME.yml``."""
    if kind == "host_vars":
        sources = inventory.host_sources.get(name) or []
    else:
        group = inventory.groups.get(name)
        sources = list(group.files) if group else []
    files = [s for s in sources if s.sourced is not None and s.label == f"{kind} {name}"]
    setting = [s for s in files if isinstance(s.values, dict) and key in s.values]
    chosen = (setting or files or [None])[-1 if setting else 0]
    if chosen is not None:
        return Path(chosen.sourced.path)
    return Path(inventory.root).parent / kind / f"{name}.yml"  # root: the inventory's hosts.yml
