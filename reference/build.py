"""The reference pages, made from what the code declares, never written by hand (as ansible-doc
makes a role's page from its argument_specs): `python3 -m reference.build` writes

- docs/reference/inventory.md: every inventory key of the schemas (schemas/connection.schema.json,
  each role's schema.yml in the order the roles run, kubernetes_manifests/schema.yml), with its
  type, default (the role's defaults/main.yml), allowed values, an example (the shipped
  inventory's value, else the default, else an allowed value), which part reads it and where it
  may be set; an object's keys beneath it;
- docs/reference/tasks.md: every `invoke` task (tasks.py's collection) with its help and options,
  from the tasks' own docstrings and option help.

tests/test_reference.py checks the pages are what this writes: a key or a task added, changed or
removed without `python3 -m reference.build` fails it."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "reference"
WHERE = ("a host or a group: `hosts.yml` (under a host, or a group's `vars:`), `group_vars/GROUP.yml`, "
         "`host_vars/HOST.yml`; for one run, `--set KEY=VALUE`")
HEADER = "<!-- Written by `python3 -m reference.build` from the {what}: do not edit; run it again. -->\n\n"


# ---------------------------------------------------------------- the inventory's keys

def schema_sources() -> list[tuple[str, str, dict, dict]]:
    """(what reads it, where its schema is, the schema, its defaults) in the order they are read."""
    from roles import ORDER
    out = [("the connection (every task)", "schemas/connection.schema.json",
            json.loads((ROOT / "schemas" / "connection.schema.json").read_text()), {})]
    for name in ORDER:
        schema = yaml.safe_load((ROOT / "roles" / name / "schema.yml").read_text())
        defaults = yaml.safe_load((ROOT / "roles" / name / "defaults" / "main.yml").read_text()) or {}
        out.append((f"the {name} role", f"roles/{name}/schema.yml", schema, defaults))
    out.append(("`invoke render --target kubernetes`", "kubernetes_manifests/schema.yml",
                yaml.safe_load((ROOT / "kubernetes_manifests" / "schema.yml").read_text()), {}))
    return out


def shipped_values() -> dict:
    """What the shipped example inventory (inventory/) sets, key -> the first value found."""
    found: dict = {}
    folder = ROOT / "inventory"
    files = [folder / "hosts.yml", *sorted((folder / "group_vars").glob("*.yml")),
             *sorted((folder / "host_vars").glob("*.yml"))]
    for path in files:
        data = yaml.safe_load(path.read_text()) or {}
        if path.name == "hosts.yml":
            _hosts_vars(data.get("all") or {}, found)
        elif isinstance(data, dict):
            for key, value in data.items():
                found.setdefault(key, value)
    return found


def _hosts_vars(group: dict, found: dict):
    for key, value in (group.get("vars") or {}).items():
        found.setdefault(key, value)
    for host in (group.get("hosts") or {}).values():
        for key, value in (host or {}).items():
            found.setdefault(key, value)
    for child in (group.get("children") or {}).values():
        _hosts_vars(child or {}, found)


def _resolved(schema: dict, spec: dict) -> dict:
    while isinstance(spec, dict) and "$ref" in spec:
        spec = schema.get("$defs", {}).get(spec["$ref"].rsplit("/", 1)[-1], {})
    return spec or {}


def type_of(schema: dict, spec: dict) -> str:
    spec = _resolved(schema, spec)
    if "enum" in spec:
        kinds = sorted({type(v).__name__.replace("str", "string").replace("NoneType", "null") for v in spec["enum"]})
        return " or ".join(kinds)
    if "const" in spec:
        return "constant"
    for combo in ("oneOf", "anyOf"):
        if combo in spec:
            return " or ".join(dict.fromkeys(type_of(schema, s) for s in spec[combo]))
    kind = spec.get("type", "any")
    if isinstance(kind, list):
        return " or ".join(kind)
    if kind == "array":
        return f"list of {type_of(schema, spec.get('items') or {})}"
    if kind == "object" and "additionalProperties" in spec and isinstance(spec["additionalProperties"], dict):
        return f"mapping of {type_of(schema, spec['additionalProperties'])}"
    return kind


def allowed(schema: dict, spec: dict) -> str:
    spec = _resolved(schema, spec)
    parts = []
    if "enum" in spec:
        parts.append("one of " + ", ".join(f"`{_flow(v)}`" for v in spec["enum"]))
    if "const" in spec:
        parts.append(f"`{_flow(spec['const'])}`")
    bounds = [("minimum", ">="), ("exclusiveMinimum", ">"), ("maximum", "<="), ("exclusiveMaximum", "<")]
    parts += [f"{sign} {spec[k]:g}" if isinstance(spec[k], float) else f"{sign} {spec[k]}" for k, sign in bounds
              if k in spec]
    if "pattern" in spec:
        parts.append(f"matches `{spec['pattern']}`")
    if "minItems" in spec or "maxItems" in spec:
        parts.append(f"{spec.get('minItems', 0)} to {spec.get('maxItems', 'any number of')} items")
    if spec.get("type") == "array":
        inner = allowed(schema, spec.get("items") or {})
        if inner:
            parts.append(f"each item: {inner}")
    for combo in ("oneOf", "anyOf"):
        for option in spec.get(combo, ()):
            inner = allowed(schema, option)
            if inner:
                parts.append(f"or {inner}")
    return "; ".join(parts)


def _flow(value) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10 ** 6).strip()
    text = text.removesuffix("\n...").removesuffix("...").strip()
    return text if len(text) <= 80 else text[:77] + "..."


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _example(name: str, spec: dict, schema: dict, default, shipped: dict):
    if name in shipped:
        return shipped[name]
    if default is not None:
        return default
    spec = _resolved(schema, spec)
    if "enum" in spec:
        return spec["enum"][0]
    if "examples" in spec:
        return spec["examples"][0]
    return None


def key_rows(schema: dict, properties: dict, defaults: dict, shipped: dict, prefix: str = "") -> list[dict]:
    rows = []
    for name, spec in properties.items():
        full = f"{prefix}{name}"
        resolved = _resolved(schema, spec)
        default = defaults.get(name) if not prefix else None
        rows.append({"name": full, "type": type_of(schema, spec), "default": default,
                     "allowed": allowed(schema, spec),
                     "description": spec.get("description") or resolved.get("description") or "",
                     "example": _example(name, spec, schema, default, shipped if not prefix else {})})
        if resolved.get("type") == "object" and isinstance(resolved.get("properties"), dict):
            rows += key_rows(schema, resolved["properties"], {}, {}, f"{full}.")
        items = _resolved(schema, resolved.get("items") or {})
        if resolved.get("type") == "array" and isinstance(items.get("properties"), dict):
            rows += key_rows(schema, items["properties"], {}, {}, f"{full}[].")
    return rows


def inventory_page() -> str:
    shipped = shipped_values()
    sections, count = [], 0
    for reader, where, schema, defaults in schema_sources():
        rows = key_rows(schema, schema.get("properties") or {}, defaults, shipped)
        count += sum(1 for r in rows if "." not in r["name"] and "[]" not in r["name"])
        lines = [f"## {reader}", "", f"Schema: `{where}`.", ""]
        for row in rows:
            lines.append(f"### `{row['name']}`")
            lines.append("")
            if row["description"]:
                lines.append(_cell(row["description"]))
                lines.append("")
            lines.append(f"- type: {row['type']}")
            if row["allowed"]:
                lines.append(f"- allowed: {_cell(row['allowed'])}")
            if row["default"] is not None:
                lines.append(f"- default: `{_flow(row['default'])}`")
            if row["example"] is not None:
                lines.append(f"- example: `{row['name'].split('.')[-1].removesuffix('[]')}: {_flow(row['example'])}`")
            lines.append(f"- read by: {reader}")
            if "." not in row["name"] and "[]" not in row["name"]:
                lines.append(f"- set in: {WHERE}")
            lines.append("")
        sections.append("\n".join(lines))
    head = (HEADER.format(what="schemas and the roles' defaults") + "# Inventory keys\n\n"
            f"Every key an inventory may set ({count} at the top level), by what reads it. Precedence, lowest "
            "first: the roles' defaults < group `all` < other groups (parents before children) < the host < "
            "`--set`. `invoke inventory.check` checks every value against these schemas and names the file and "
            "line of a wrong one.\n\n")
    return head + "\n".join(sections)


# ---------------------------------------------------------------- the tasks

def task_rows():
    import tasks
    ns = tasks.ns
    for name in sorted(ns.task_names):
        task = ns[name]
        yield name, task


def tasks_page() -> str:
    lines = [HEADER.format(what="tasks' own help").rstrip("\n"), "", "# Tasks", "",
             "Every `invoke` task, with its options (`invoke --help TASK` says the same). The inventory is "
             "`--inventory DIR`, else `$DGEMMA_INVENTORY`, else `inventory/`; an option goes after its task "
             "(`invoke deploy --inventory DIR`).", ""]
    for name, task in task_rows():
        doc = " ".join((task.__doc__ or "").split())
        lines += [f"## `invoke {name}`", "", doc or "(no help)", ""]
        # Invoke's get_arguments takes each option's help out of task.help as it reads it: a copy's
        reading = copy.copy(task)
        reading.help = dict(task.help)
        arguments = [a for a in reading.get_arguments() if not a.name.startswith("_")]
        positional = [a for a in arguments if a.positional]
        if positional:
            lines.append("Arguments: " + ", ".join(f"`{a.name.upper()}`" + (f" ({_cell(a.help)})" if a.help else "")
                                                  for a in positional))
            lines.append("")
        options = [a for a in arguments if not a.positional]
        if options:
            lines += ["| option | value | default | what it does |", "|---|---|---|---|"]
            for arg in sorted(options, key=lambda a: a.names[0]):
                flags = ", ".join(f"`-{n}`" if len(n) == 1 else f"`--{n}`" for n in arg.names)
                kind = {bool: "", int: "INT", list: "VALUE (repeatable)"}.get(arg.kind, "STRING")
                default = "" if arg.default in (None, False, [], "") else f"`{arg.default}`"
                lines.append(f"| {flags} | {kind} | {default} | {_cell(arg.help or '')} |")
            lines.append("")
    return "\n".join(lines)


def render() -> dict[str, str]:
    return {"inventory.md": inventory_page(), "tasks.md": tasks_page()}


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    for file_name, text in render().items():
        (OUT / file_name).write_text(text)
        print(f"wrote docs/reference/{file_name}")
