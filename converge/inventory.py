"""Ansible-style inventory: ``hosts.yml``, ``group_vars/``, ``host_vars/``.

Precedence, lowest first: role defaults < group ``all`` < other groups (parents
before children, then by name) < the host's own vars < ``--set`` on the command
line. Within one level a ``group_vars``/``host_vars`` file overrides the vars
written in ``hosts.yml``, as Ansible does. Every resolved value remembers the
file and line it came from, so that a bad value is reported where it was set.
"""
from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from . import yamlsrc
from .errors import InventoryError

CLI = "command line"
# what Ansible accepts without warnings, and what is safe in a file name or an ssh_config
HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,62})$")
GROUP_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
MAX_OVERRIDE = 4096


def shown(value, limit: int = 60) -> str:
    """A value as a message shows it: quoted (repr: printable, one line), not too long."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def shown_key(key, limit: int = 60) -> str:
    """A key as a message shows it: as written when plain, else like a value."""
    return key if isinstance(key, str) and key.isprintable() and " " not in key and len(key) <= limit \
        else shown(key, limit)


@dataclass(frozen=True)
class Origin:
    """Where a value was set: a file and line, or the command line."""

    file: str
    line: int | None = None

    def __str__(self):
        return f"{self.file}:{self.line}" if self.line else self.file


@dataclass
class VarSource:
    """One mapping of variables as written in one place."""

    label: str  # e.g. "group rtx", "host rtx01", "role defaults service"
    values: dict
    origins: dict[str, Origin]
    # line lookup for nested keys: (key, sub, ...) -> line
    sourced: yamlsrc.Sourced | None = None
    prefix: tuple = ()

    def origin_of(self, keypath: tuple) -> Origin:
        if self.sourced is None:
            return self.origins.get(keypath[0], Origin(self.label)) if keypath else Origin(self.label)
        return Origin(_display(self.sourced.path), self.sourced.line_of(self.prefix + tuple(keypath)))


@dataclass
class Host:
    name: str
    groups: list[str]
    vars: dict = field(default_factory=dict)
    # the sources that made this host's vars, lowest precedence first (a value's file and line:
    # the last source that sets it, `VarSource.origin_of`, read only where a problem is reported)
    sources: list[VarSource] = field(default_factory=list)


@dataclass
class Group:
    name: str
    hosts: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    parents: list[str] = field(default_factory=list)
    vars: VarSource | None = None
    files: list[VarSource] = field(default_factory=list)


@dataclass
class Inventory:
    root: Path
    groups: dict[str, Group]
    host_sources: dict[str, list[VarSource]]
    host_order: list[str]

    @property
    def host_names(self) -> list[str]:
        return list(self.host_order)

    def select(self, patterns: str | list[str] | None) -> list[str]:
        """Host names for ``--hosts``: comma separated names or group names.

        An unknown name is an error that lists the known hosts and groups.
        """
        if not patterns:
            return self.host_names
        if isinstance(patterns, str):
            patterns = [p for p in patterns.split(",")]
        chosen: list[str] = []
        for raw in patterns:
            name = raw.strip()
            if not name:
                continue
            if name in self.host_sources:
                found = [name]
            elif name in self.groups:
                found = self.group_hosts(name)
            else:
                close = difflib.get_close_matches(name, list(self.host_sources) + list(self.groups), n=1)
                hint = f" Did you mean {close[0]!r}?" if close else ""
                raise InventoryError([
                    f"{_display(self.root)}: unknown host or group {name!r} in --hosts.{hint} "
                    f"Known hosts: {', '.join(self.host_names) or '(none)'}; "
                    f"groups: {', '.join(g for g in self.groups if g != 'all')}"])
            for host in found:
                if host not in chosen:
                    chosen.append(host)
        return chosen

    def group_hosts(self, group: str) -> list[str]:
        seen: set[str] = set()
        visited: set[str] = set()
        stack = [group]
        while stack:
            name = stack.pop()
            if name in visited:
                continue
            visited.add(name)
            seen.update(self.groups[name].hosts)
            stack.extend(self.groups[name].children)
        return [h for h in self.host_order if h in seen]

    def groups_of(self, host: str) -> list[str]:
        """The host's groups, ordered for precedence: ``all`` first, then by
        depth (parents before children), then by name."""
        direct = [g.name for g in self.groups.values() if host in g.hosts]
        found: set[str] = set()
        stack = list(direct)
        while stack:
            g = stack.pop()
            if g in found:
                continue
            found.add(g)
            stack.extend(self.groups[g].parents)
        found.add("all")

        def depth(name, trail=()):
            parents = [p for p in self.groups[name].parents if p not in trail]
            return 0 if name == "all" else 1 + max((depth(p, trail + (name,)) for p in parents), default=0)

        return sorted(found, key=lambda g: (depth(g), g != "all", g))

    def host(self, name: str, defaults: list[VarSource] = (), overrides: dict | None = None) -> Host:
        """Resolve one host's variables with full precedence."""
        sources: list[VarSource] = list(defaults)
        groups = self.groups_of(name)
        for g in groups:
            group = self.groups[g]
            if group.vars is not None:
                sources.append(group.vars)
            sources.extend(group.files)
        sources.extend(self.host_sources[name])
        if overrides:
            sources.append(VarSource(CLI, dict(overrides), {k: Origin("--set " + k) for k in overrides}))
        merged: dict = {}
        for src in sources:
            merged.update(src.values)
        return Host(name=name, groups=groups, vars=merged, sources=sources)


def _group_loop(groups: dict[str, Group]) -> list[str] | None:
    """A cycle of groups through ``children`` (``[a, b, a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(name: str, trail: list[str]) -> list[str] | None:
        state[name] = 1
        for child in groups[name].children:
            if state.get(child) == 1:
                return trail[trail.index(child):] + [child] if child in trail else [name, child]
            if child not in state:
                found = visit(child, trail + [child])
                if found:
                    return found
        state[name] = 2
        return None

    for name in groups:
        if name not in state:
            found = visit(name, [name])
            if found:
                return found
    return None


def _where(data, parent: str, child: str) -> tuple:
    """The key path of ``child`` under ``parent``'s children in hosts.yml (for its line)."""
    stack = [(("all",), data.get("all") if isinstance(data, dict) else None)]
    while stack:
        path, body = stack.pop()
        children = body.get("children") if isinstance(body, dict) else None
        if not isinstance(children, dict):
            continue
        for name, sub in children.items():
            if path[-1] == parent and name == child:
                return path + ("children", name)
            if len(path) < 64:
                stack.append((path + ("children", name), sub))
    return ("all",)


def _display(path: Path) -> str:
    return _display_cached(str(path), os.getcwd())


@lru_cache(maxsize=4096)
def _display_cached(path: str, cwd: str) -> str:
    """A path as messages show it: relative to where we run, if inside it (one resolve per file)."""
    try:
        return str(Path(path).resolve().relative_to(Path(cwd).resolve()))
    except (ValueError, RuntimeError, OSError):  # outside cwd, or a symbolic link loop (said elsewhere)
        return path


def yaml_problem(where: str, exc: yaml.YAMLError) -> str:
    """One line for a YAML error: where, the line, what PyYAML found."""
    mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
    line = f":{mark.line + 1}" if mark else ""
    what = " ".join(str(getattr(exc, "problem", None) or exc).split())
    return f"{where}{line}: YAML syntax error: {what}. Fix the file's indentation or quoting."


def _load(path: Path, problems: list[str]) -> yamlsrc.Sourced | None:
    try:
        return yamlsrc.load(path)
    except yaml.YAMLError as exc:
        problems.append(yaml_problem(_display(path), exc))
    except yamlsrc.InputError as exc:
        problems.append(f"{_display(path)}{':' + str(exc.line) if exc.line else ''}: {exc.message}")
    except OSError as exc:
        problems.append(f"{_display(path)}: cannot read: {exc.strerror}")
    return None


def _entries(directory: Path) -> frozenset[str]:
    """The names in ``directory`` (none where it is not a folder)."""
    try:
        return frozenset(os.listdir(directory))
    except OSError:
        return frozenset()


def _var_files(directory: Path, name: str, problems: list[str], entries: frozenset[str]) -> list[Path]:
    """``group_vars/NAME.yml`` (or .yaml, or no suffix) and ``group_vars/NAME/*.yml``, of the
    folder's ``entries`` (listed once: a name it does not hold costs no lookup, which an
    inventory of thousands of hosts with few vars files would otherwise pay three times a host).
    A symbolic link that leads nowhere (missing, or a loop) is a problem, not a file
    quietly left out."""
    files = [directory / f"{name}{suffix}" for suffix in (".yml", ".yaml", "") if f"{name}{suffix}" in entries]
    folder = directory / name
    if name in entries and folder.is_dir():
        files.extend(sorted(p for p in folder.iterdir() if p.suffix in (".yml", ".yaml")))
    for f in files:
        if f.is_symlink() and not f.exists():
            problems.append(f"{_display(f)}:1: a symbolic link that leads nowhere (to {os.readlink(f)!r}: missing, "
                            f"or a loop): point it at a vars file or remove it")
    return [f for f in files if f.is_file()]


def _mapping_source(label: str, sourced: yamlsrc.Sourced, prefix: tuple, values, problems) -> VarSource | None:
    if values is None:
        values = {}
    if not isinstance(values, dict):
        line = sourced.line_of(prefix)
        problems.append(f"{_display(sourced.path)}:{line}: {'.'.join(map(str, prefix)) or '(top)'}: "
                        f"expected a mapping of variables, got {type(values).__name__}")
        return None
    return VarSource(label, values, {}, sourced=sourced, prefix=prefix)


def load_inventory(root: str | Path, path_variable: str | None = None) -> Inventory:
    """Read an inventory directory (or a ``hosts.yml`` file beside its vars dirs).

    Raises InventoryError listing every structural problem found, with file:line.
    """
    root = Path(root)
    hosts_file = root if root.is_file() else next(
        (root / n for n in ("hosts.yml", "hosts.yaml") if (root / n).is_file()), root / "hosts.yml")
    base = hosts_file.parent
    problems: list[str] = []
    if not hosts_file.is_file():
        raise InventoryError([f"{_display(hosts_file)}: no inventory here. Pass --inventory DIR"
                              f"{', or set ' + path_variable if path_variable else ''}, to a folder holding "
                              f"hosts.yml."])
    doc = _load(hosts_file, problems)
    if doc is None:
        raise InventoryError(problems)
    data = doc.data
    if not isinstance(data, dict) or "all" not in data or set(data) - {"all"}:
        extra = sorted(set(data) - {"all"}) if isinstance(data, dict) else []
        what = f"unexpected top-level keys {extra}; put every group under all.children" if extra else \
            "the top level must be a mapping with a single key 'all'"
        raise InventoryError([f"{_display(hosts_file)}:1: {what}"])

    groups: dict[str, Group] = {}
    host_sources: dict[str, list[VarSource]] = {}
    host_order: list[str] = []

    def walk(name: str, body, path: tuple, parent: str | None):
        group = groups.setdefault(name, Group(name))
        if parent and parent not in group.parents:
            group.parents.append(parent)
        if parent and name not in groups[parent].children:
            groups[parent].children.append(name)
        if body is None:
            return
        line = doc.line_of(path)
        if not isinstance(body, dict):
            problems.append(f"{_display(hosts_file)}:{line}: {'.'.join(path)}: expected a mapping with "
                            f"hosts, vars or children")
            return
        for key in body:
            if key not in ("hosts", "vars", "children"):
                close = difflib.get_close_matches(str(key), ["hosts", "vars", "children"], n=1)
                hint = f"; did you mean {close[0]!r}?" if close else "; a group holds hosts, vars and children"
                problems.append(f"{_display(hosts_file)}:{doc.line_of(path + (key,))}: "
                                f"{'.'.join(map(shown_key, path + (key,)))}: unknown key{hint}")
        if "vars" in body:
            group.vars = _mapping_source(f"group {name}", doc, path + ("vars",), body["vars"], problems)
        hosts = body.get("hosts") or {}
        if not isinstance(hosts, dict):
            problems.append(f"{_display(hosts_file)}:{doc.line_of(path + ('hosts',))}: "
                            f"{'.'.join(path)}.hosts: expected a mapping of host names")
            hosts = {}
        for host, hvars in hosts.items():
            if not isinstance(host, str) or not HOST_NAME.match(host):
                problems.append(f"{_display(hosts_file)}:{doc.line_of(path + ('hosts', host))}: "
                                f"{'.'.join(path)}.hosts: host name {shown(host)} is not allowed: letters, digits, "
                                f"dots, underscores and dashes, up to 63, starting with a letter or digit")
                continue
            if host not in group.hosts:
                group.hosts.append(host)
            if host not in host_sources:
                host_sources[host] = []
                host_order.append(host)
            src = _mapping_source(f"host {host}", doc, path + ("hosts", host), hvars, problems)
            if src is not None and src.values:
                host_sources[host].append(src)
        children = body.get("children") or {}
        if not isinstance(children, dict):
            problems.append(f"{_display(hosts_file)}:{doc.line_of(path + ('children',))}: "
                            f"{'.'.join(path)}.children: expected a mapping of group names")
            children = {}
        for child, child_body in children.items():
            if not isinstance(child, str) or not GROUP_NAME.match(child):
                problems.append(f"{_display(hosts_file)}:{doc.line_of(path + ('children', child))}: "
                                f"{'.'.join(path)}.children: group name {shown(child)} is not allowed: letters, "
                                f"digits and underscores, up to 63, not starting with a digit")
                continue
            walk(child, child_body, path + ("children", child), name)

    walk("all", data["all"], ("all",), None)
    loop = _group_loop(groups)
    if loop:
        line = doc.line_of(_where(doc.data, loop[-2], loop[-1]))
        raise InventoryError(problems + [
            f"{_display(hosts_file)}:{line}: group {loop[0]!r} is its own descendant "
            f"({' -> '.join(loop)}): Ansible refuses such a loop too; remove one of these children links"])

    entries = {kind: _entries(base / kind) for kind in ("group_vars", "host_vars")}
    for gname, group in groups.items():
        for f in _var_files(base / "group_vars", gname, problems, entries["group_vars"]):
            sourced = _load(f, problems)
            if sourced is not None:
                src = _mapping_source(f"group_vars {gname}", sourced, (), sourced.data, problems)
                if src is not None:
                    group.files.append(src)
    for hname in host_order:
        for f in _var_files(base / "host_vars", hname, problems, entries["host_vars"]):
            sourced = _load(f, problems)
            if sourced is not None:
                src = _mapping_source(f"host_vars {hname}", sourced, (), sourced.data, problems)
                if src is not None:
                    host_sources[hname].append(src)
    # vars files for hosts or groups that do not exist are almost always typos
    for kind, known in (("group_vars", groups), ("host_vars", host_sources)):
        for f in sorted(base / kind / entry for entry in entries[kind]):  # the listing above
            stem = f.stem if f.suffix in (".yml", ".yaml") and not f.is_dir() else f.name
            if f.name.startswith(".") or stem in known:
                continue
            close = difflib.get_close_matches(stem, list(known), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            problems.append(f"{_display(f)}:1: no {'group' if kind == 'group_vars' else 'host'} "
                            f"named {stem!r} in {_display(hosts_file)}{hint}")
    if problems:
        raise InventoryError(problems)
    return Inventory(root=hosts_file, groups=groups, host_sources=host_sources, host_order=host_order)


def parse_overrides(pairs: list[str] | str | None) -> dict:
    """``--set key=value`` pairs; values are read as YAML scalars (``0.7``, ``true``)."""
    if not pairs:
        return {}
    if isinstance(pairs, str):
        pairs = [pairs]
    out = {}
    problems = []
    for pair in pairs:
        for item in pair.split(",") if "=" in pair and pair.count("=") > 1 and "," in pair else [pair]:
            if len(item) > MAX_OVERRIDE:
                problems.append(f"--set {shown(item)}: longer than {MAX_OVERRIDE} characters")
                continue
            if "=" not in item:
                problems.append(f"--set {shown(item)}: expected key=value")
                continue
            key, _, raw = item.partition("=")
            key = key.strip()
            if not re.fullmatch(r"[a-z_][a-z0-9_]{0,63}", key):
                problems.append(f"--set {shown(item)}: {shown(key)} is not a variable name")
                continue
            try:
                # a YAML value as in a vars file (0.7, true, [a, b]), within the same bounds
                value = yamlsrc.load_text(raw).data if raw.strip() else ""
            except (yaml.YAMLError, yamlsrc.InputError):
                value = raw
            out[key] = value
    if problems:
        raise InventoryError(problems)
    return out
