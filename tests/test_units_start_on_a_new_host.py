"""Every unit the roles install starts on a host that never had it, and again after a reboot.

A unit names folders and files that must be there before systemd runs it: the sandbox's
paths (``ReadWritePaths=`` and its kin: systemd sets up the unit's mount namespace before any
``ExecStartPre=`` runs, ``+`` or not, and fails the start when one is missing), its
``EnvironmentFile=``, ``WorkingDirectory=``, and the folders a container unit mounts
(``-v SRC:DST``: podman refuses a source that is not there). Each must be made by the unit
itself (``RuntimeDirectory=`` and its kin; for a container's mount, an ``ExecStartPre=`` that
makes it) or, where it outlives a reboot, by a step of the deploy that runs before the unit
starts. A path in ``/run`` (or ``/tmp``) is emptied at every boot, when no deploy runs: only the
unit itself can make it.

The plans are the roles' own, on fresh hosts (tests/plans' ``fresh`` cases, every role up to
the case's, in order, as deploy runs them), so a new service of any role is checked here.
This check failed on the usage service of 63787a2 (issue 47: ``ReadWritePaths=/run/dgemma-gateway``,
made only by the gateway's HAProxy unit, which starts after it)."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass

import pytest

from converge.changes import Command, File
from tests import plans

# (case, the last role to run): a host of each kind the roles serve, both runtimes (spark01: Docker)
CASES = [("gateway/fresh-host", None), ("shared_address/fresh-host", None), ("monitoring/fresh-monitor01", None),
         ("exporters/fresh-rtx01", None), ("service/two-replicas-fresh", "exporters"),
         ("service/noop-spark01", "exporters")]
VOLATILE = ("/run/", "/var/run/", "/tmp/", "/dev/shm/")
# what the operating system has before anything of ours (a unit's program, /etc itself)
SYSTEM = ("/usr/", "/bin/", "/sbin/", "/lib/", "/lib64/", "/dev/", "/proc/", "/sys/")
# the folders systemd makes for a unit, by the directive that names them (relative to these)
MADE_BY_SYSTEMD = {"RuntimeDirectory": "/run", "StateDirectory": "/var/lib", "CacheDirectory": "/var/cache",
                   "LogsDirectory": "/var/log", "ConfigurationDirectory": "/etc"}
SANDBOX_PATHS = ("ReadWritePaths", "ReadOnlyPaths", "InaccessiblePaths", "ExecPaths", "NoExecPaths")
SANDBOX_BINDS = ("BindPaths", "BindReadOnlyPaths")


def parse_unit(text: str) -> dict[str, list[str]]:
    """[Service]'s directives, each to its values in order (continuation lines joined)."""
    joined = re.sub(r"\\\n", " ", text)
    section, out = None, {}
    for line in joined.splitlines():
        line = line.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "Service" and "=" in line:
            key, _, value = line.partition("=")
            out.setdefault(key.strip(), []).append(value.strip())
    return out


@dataclass(frozen=True)
class Need:
    path: str
    why: str  # the directive that needs it
    sandbox: bool  # needed before the unit's first process (no ExecStartPre can make it)


def _under(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def needs(service: dict[str, list[str]]) -> list[Need]:
    """The paths a unit needs to be there before it runs."""
    found = []
    for key in SANDBOX_PATHS:
        for value in service.get(key, []):
            for entry in value.split():
                if not entry.startswith("-"):
                    found.append(Need(entry.lstrip("+"), f"{key}=", True))
    for key in SANDBOX_BINDS:
        for value in service.get(key, []):
            for entry in value.split():
                if not entry.startswith("-"):
                    found.append(Need(entry.split(":", 1)[0], f"{key}=", True))
    for key in ("EnvironmentFile", "WorkingDirectory"):
        for value in service.get(key, []):
            if not value.startswith(("-", "~")):
                found.append(Need(value, f"{key}=", True))
    for line in service.get("ExecStart", []):
        words = shlex.split(line)
        # a script the unit runs through its interpreter (/bin/sh collector.sh, python3 usage_service.py)
        if len(words) > 1 and re.search(r"/(sh|dash|bash|python3)$", words[0]) and words[1].startswith("/"):
            found.append(Need(words[1], "ExecStart= (the program it runs)", False))
        for flag, value in zip(words, words[1:]):
            if flag in ("-v", "--volume") and value.startswith("/"):
                found.append(Need(value.split(":", 1)[0], f"ExecStart= (the container's mount {value})", False))
    return found


def made_by_unit(need: Need, service: dict[str, list[str]]) -> bool:
    for key, base in MADE_BY_SYSTEMD.items():
        for value in service.get(key, []):
            if any(_under(need.path, f"{base}/{name}") for name in value.split()):
                return True
    if need.sandbox:
        return False
    # a container's mount, made by a step of its own before the container starts
    return any(re.search(r"\bmkdir\b.*(^|\s)" + re.escape(need.path) + r"(\s|$)", line)
               for line in service.get("ExecStartPre", []))


def made_by_step(path: str, step) -> bool:
    if isinstance(step, File):  # the engine's write makes the file's folders (converge/changes.py)
        return _under(step.path, path)
    if isinstance(step, Command):
        # serving/files/folders.sh: FOLDERS, "MODE OWNER GROUP PATH" a line
        folders = re.search(r"^FOLDERS=('[^']*'|\S*)$", step.script, re.M)
        if folders and path in [line.split(None, 3)[3] for line in shlex.split(folders.group(1))[0].splitlines()]:
            return True
        return any(re.search(r"\b(mkdir|install -d)\b", line) and path in shlex.split(line)
                   for line in step.script.splitlines() if "mkdir" in line or "install" in line)
    return False


def starts(step, unit: str) -> bool:
    # a systemctl of its own, or serving/files/systemd.sh's (a program that ends in it) told to start it
    return isinstance(step, Command) and unit in step.script and bool(
        re.search(r"systemctl (re)?start", step.script) or re.search(r"^ACTION=(re)?start$", step.script, re.M))


def problems(taken) -> list[str]:
    """What a unit of this plan needs that neither it nor a step before its start makes."""
    steps = [t.step for t in taken]
    out = []
    for i, step in enumerate(steps):
        if not (isinstance(step, File) and re.fullmatch(r"/etc/systemd/system/[^/]+\.service", step.path)):
            continue
        unit = step.path.rsplit("/", 1)[1]
        service = parse_unit(step.content)
        start = next((j for j in range(i + 1, len(steps)) if starts(steps[j], unit)), len(steps))
        for need in needs(service):
            if made_by_unit(need, service) or (any(_under(need.path, s) for s in SYSTEM)
                                               and not _under(need.path, "/usr/local")):
                continue
            if need.path.startswith(VOLATILE):
                out.append(f"{unit}: {need.why} needs {need.path}, in a folder emptied at every boot: the unit "
                           f"must make it itself (RuntimeDirectory=)")
            elif not any(made_by_step(need.path, s) for s in steps[:start]):
                out.append(f"{unit}: {need.why} needs {need.path}, which no step makes before the unit starts")
    return out


def plan_of(name: str, last_role: str | None):
    case = plans.load(plans.HERE / "cases" / f"{name}.json")
    case["role"] = last_role or case["role"]
    return plans.run(case).taken


@pytest.mark.parametrize("name,last_role", CASES, ids=[f"{n}{'-to-' + r if r else ''}" for n, r in CASES])
def test_every_unit_finds_what_it_needs_on_a_new_host_and_after_a_reboot(name, last_role):
    taken = plan_of(name, last_role)
    units = [t.step.path for t in taken if isinstance(t.step, File) and t.step.path.endswith(".service")]
    assert units, f"{name}: the plan installs no unit"
    assert problems(taken) == []


USAGE_AT_63787A2 = """\
[Unit]
Before=podman-dgemma-gateway.service

[Service]
ExecStart=/usr/bin/python3 /usr/local/lib/dgemma/usage_service.py --socket /run/dgemma-gateway/usage.sock
ProtectSystem=strict
ExecStartPre=+/bin/mkdir -p /run/dgemma-gateway
ReadWritePaths=/run/dgemma-gateway
StateDirectory=dgemma/usage
"""


def test_the_check_finds_what_a_new_host_lacks():
    """The usage service of 63787a2, a mount of a folder nothing makes, a missing environment
    file: each found, each named; a folder made in time, or optional, is not."""
    unit = File("usage unit", path="/etc/systemd/system/dgemma-usage.service", content=USAGE_AT_63787A2)
    program = File("usage service", path="/usr/local/lib/dgemma/usage_service.py", content="")
    start = Command("usage running", script="systemctl start dgemma-usage.service\n")
    found = problems([plans.Taken("gateway", s, False) for s in (program, unit, start)])
    assert found == ["dgemma-usage.service: ReadWritePaths= needs /run/dgemma-gateway, in a folder emptied at every "
                     "boot: the unit must make it itself (RuntimeDirectory=)"]
    container = File("unit", path="/etc/systemd/system/podman-x.service", content=(
        "[Service]\nEnvironmentFile=/etc/dgemma/x.env\nEnvironmentFile=-/etc/dgemma/optional.env\n"
        "ExecStartPre=/bin/mkdir -p /run/x\n"
        "ExecStart=/usr/bin/podman run -v /run/x:/run/x -v /var/lib/x:/data:ro -v /srv/made:/m image\n"))
    made = Command("folders", script="mkdir -p /srv/made\n")
    run = Command("x running", script="systemctl start podman-x.service\n")
    late = File("env", path="/etc/dgemma/x.env", content="A=1\n")
    found = problems([plans.Taken("r", s, False) for s in (made, container, run, late)])
    assert found == ["podman-x.service: EnvironmentFile= needs /etc/dgemma/x.env, which no step makes before the "
                     "unit starts",
                     "podman-x.service: ExecStart= (the container's mount /var/lib/x:/data:ro) needs /var/lib/x, "
                     "which no step makes before the unit starts"]
