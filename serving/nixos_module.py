"""NixOS hosts: units are declared in the system configuration, not written to
/etc/systemd/system (a link into the read-only Nix store there). The service
becomes a module of ``virtualisation.oci-containers``, written to /etc/nixos/,
whose generated unit has our unit's name (``<runtime>-<name>.service``). Pure."""
from __future__ import annotations

import json
import re

from serving.replicas import service

NIXOS_DIR = "/etc/nixos"
CONFIGURATION = f"{NIXOS_DIR}/configuration.nix"


def module_name(v: dict) -> str:
    return f"dgemma-{service(v)}.nix"


def module_path(v: dict) -> str:
    return f"{NIXOS_DIR}/{module_name(v)}"


def imports_line(v: dict) -> str:
    """The line that makes configuration.nix use the module."""
    return f"imports = [ ./{module_name(v)} ];"


def nix_string(text: str) -> str:
    """A Nix string literal: quotes, backslashes and ``${`` escaped."""
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("${", "\\${")
    escaped = escaped.replace("\n", "\\n").replace("\r", "\\r").replace("\t", "\\t")
    return f'"{escaped}"'


def nix_value(value) -> str:
    """Python data as a Nix expression (strings, numbers, booleans, lists, attribute sets)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return json.dumps(value)
    if isinstance(value, str):
        return nix_string(value)
    if isinstance(value, (list, tuple)):
        return "[ " + " ".join(nix_value(v) for v in value) + " ]" if value else "[ ]"
    if isinstance(value, dict):
        if not value:
            return "{ }"
        return "{ " + " ".join(f"{_attr(k)} = {nix_value(v)};" for k, v in value.items()) + " }"
    raise TypeError(f"no Nix form for {value!r}")


def _attr(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_'-]*", name) else nix_string(name)


def imported(configuration_files: dict[str, str], v: dict) -> bool:
    """Whether any of the host's NixOS configuration files (path -> text) imports
    the module: a line outside comments that names it."""
    name = module_name(v)
    for path, text in configuration_files.items():
        if path.endswith("/" + name):
            continue
        for line in text.splitlines():
            code = line.split("#", 1)[0]
            if re.search(rf"(^|[\s\[/]){re.escape(name)}($|[\s\]\";])", code):
                return True
    return False
