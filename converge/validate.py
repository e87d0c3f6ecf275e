"""Validate variables against JSON Schema and say where each problem was set.

Every message reads ``file:line: key.path: what was wrong, what was expected``.
Each source is checked on its own (so a bad value is reported in the file that
holds it even if something overrides it), then each host's merged variables are
checked for what only the whole can show (required keys).
"""
from __future__ import annotations

import difflib
import json
import math
import re
from pathlib import Path

import jsonschema

from .inventory import Inventory, Origin, VarSource, shown, shown_key
from .ssh_settings import parse_common_args

FORMATS = jsonschema.FormatChecker(formats=())


@FORMATS.checks("ansible-ssh-common-args", raises=ValueError)
def _common_args(value) -> bool:
    if isinstance(value, str):
        parse_common_args(value)  # raises ValueError saying what is not understood
    return True


# Ansible variables we know and refuse on purpose, with what to write instead
REFUSED_KEYS = {
    "ansible_become_password": "secrets stay out of the inventory: set become_password_file (a 0600 file) or run "
                               "with --ask-become-pass (-K)",
    "ansible_become_pass": "secrets stay out of the inventory: set become_password_file (a 0600 file) or run "
                           "with --ask-become-pass (-K)",
    "ansible_password": "password logins are not supported: use a key (ansible_ssh_private_key_file)",
    "ansible_ssh_pass": "password logins are not supported: use a key (ansible_ssh_private_key_file)",
    "ansible_ssh_extra_args": "write ssh options in ansible_ssh_common_args (ProxyJump and a few more are understood)",
}


def load_schema(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def combine(schemas: list[dict]) -> dict:
    """One object schema from several (connection settings and each role's vars).

    The same key may appear in two roles only with the same definition.
    """
    properties: dict = {}
    required: list[str] = []
    defs: dict = {}
    for schema in schemas:
        for key, spec in schema.get("properties", {}).items():
            if key in properties and properties[key] != spec:
                raise ValueError(f"variable {key!r} is declared twice with different schemas")
            properties[key] = spec
        required.extend(k for k in schema.get("required", []) if k not in required)
        defs.update(schema.get("$defs", {}))
    out = {"type": "object", "additionalProperties": False, "properties": properties, "$defs": defs}
    if required:
        out["required"] = required
    return out


def _keypath(path) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{shown_key(part)}" if text else shown_key(part))
    return text


def one_line(text: str, limit: int = 600) -> str:
    """A problem as one printable line: control characters escaped, at most ``limit`` long."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "…"


def _describe(error: jsonschema.ValidationError) -> str:
    """jsonschema's message, shortened and with the expectation spelt out."""
    v = error.validator
    inst = error.instance
    if v in ("maxLength", "minLength", "maxItems", "minItems"):
        return f"{shown(inst)} is too {'long' if v.startswith('max') else 'short'} ({v} {error.validator_value})"
    if isinstance(inst, float) and not math.isfinite(inst):
        return f"{inst!r} is not a number that can be used"
    if v == "maximum":
        return f"{shown(inst)} is greater than the maximum {error.validator_value}"
    if v == "minimum":
        return f"{shown(inst)} is less than the minimum {error.validator_value}"
    if v == "exclusiveMaximum":
        return f"{shown(inst)} must be less than {error.validator_value}"
    if v == "exclusiveMinimum":
        return f"{shown(inst)} must be greater than {error.validator_value}"
    if v == "type":
        want = error.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        return f"{shown(inst)} is {type(inst).__name__}, expected {want}"
    if v == "enum":
        return f"{shown(inst)} is not one of {', '.join(map(repr, error.validator_value))}"
    if v == "pattern":
        desc = error.schema.get("description", "")
        bad = sorted(set(re.findall(r"[;&|`$<>(){}\\\"'\s*?!#~]", str(inst))))
        why = f" (contains {' '.join(repr(c) for c in bad)})" if bad else ""
        return f"{shown(inst)} is not allowed{why}; expected {desc or 'to match ' + error.validator_value}"
    if v == "format" and error.cause is not None:
        return str(error.cause)
    if v in ("anyOf", "oneOf") and error.context:
        # the branch of the right type says it best (1.4 vs "a number up to 0.95")
        same_type = [e for e in error.context if e.validator != "type" and e.validator != "const"]
        if same_type:
            return _describe(jsonschema.exceptions.best_match(same_type))
    if v in ("anyOf", "oneOf"):
        options = [s.get("description") or s.get("type") or s.get("const") or s.get("enum") for s in error.validator_value]
        return f"{shown(inst)} is not valid; expected one of: {'; '.join(map(str, options))}"
    return one_line(error.message, 200)


def suggest(key: str, known: list[str]) -> str | None:
    """The known key closest to a misspelt one, also when only its start was
    typed (``gpu_memroy`` -> ``gpu_memory_utilization``)."""
    def score(candidate):
        whole = difflib.SequenceMatcher(None, key, candidate).ratio()
        start = difflib.SequenceMatcher(None, key, candidate[:len(key)]).ratio()
        return max(whole, start - 0.05)
    best = max(known, key=score, default=None)
    return best if best is not None and score(best) >= 0.75 else None


def check_source(validator: jsonschema.Validator, schema: dict, src: VarSource) -> list[str]:
    problems = []
    known = list(schema.get("properties", {}))
    for error in sorted(validator.iter_errors(src.values), key=lambda e: list(map(str, e.absolute_path))):
        if error.validator == "required":
            continue  # judged on the merged host vars
        path = tuple(error.absolute_path)
        if error.validator == "additionalProperties" and not path:
            extra = [k for k in error.instance if k not in schema.get("properties", {})]
            for key in extra:
                if key in REFUSED_KEYS:
                    problems.append(f"{src.origin_of((key,))}: {key}: not accepted: {REFUSED_KEYS[key]}")
                    continue
                close = suggest(str(key)[:64], known)
                hint = f"did you mean {close!r}?" if close else "no role or connection setting uses it"
                problems.append(f"{src.origin_of((key,))}: {shown_key(key)}: unknown key; {hint}")
            continue
        problems.append(f"{src.origin_of(path)}: {_keypath(path)}: {_describe(error)}")
    return [one_line(p) for p in problems] + non_finite(src)


def non_finite(src: VarSource) -> list[str]:
    """NaN and infinity pass every range check (all comparisons are false): refused here."""
    problems = []
    stack = [((), src.values)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            problems.append(f"{src.origin_of(path)}: {_keypath(path)}: {value!r} is not a number that can be used")
        elif isinstance(value, dict):
            stack.extend((path + (k,), v) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((path + (i,), v) for i, v in enumerate(value))
    return problems


def check_inventory(inventory: Inventory, schema: dict, defaults: list[VarSource] = ()) -> list[str]:
    """All problems of an inventory against the combined vars schema."""
    no_required = {k: v for k, v in schema.items() if k != "required"}
    validator = jsonschema.Draft202012Validator(no_required, format_checker=FORMATS)
    problems: list[str] = []
    seen_sources: set[int] = set()
    for name in inventory.host_names:
        host = inventory.host(name, defaults)
        for src in host.sources:
            if id(src) in seen_sources:
                continue
            seen_sources.add(id(src))
            problems.extend(check_source(validator, no_required, src))
        for missing in schema.get("required", []):
            if missing not in host.vars:
                problems.append(f"{inventory.root}: host {name}: {missing}: required and not set "
                                f"in any group_vars, host_vars or hosts.yml")
    for group in inventory.groups.values():  # groups without hosts are checked too
        for src in ([group.vars] if group.vars else []) + group.files:
            if id(src) not in seen_sources:
                seen_sources.add(id(src))
                problems.extend(check_source(validator, no_required, src))
    # one problem can surface once per host; say it once
    return list(dict.fromkeys(problems))


def check_values(values: dict, schema: dict, label: str) -> list[str]:
    """Validate a plain mapping (e.g. resolved vars with --set) naming ``label``."""
    src = VarSource(label, values, {k: Origin(label) for k in values})
    return check_source(jsonschema.Draft202012Validator(schema, format_checker=FORMATS), schema, src)
