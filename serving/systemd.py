"""systemctl's actions on a unit, and folders made, as host programs (``serving/files/systemd.sh``,
``serving/files/folders.sh``): a role says what it wants done to which unit or folder, and the host runs
the same file with those parameters. Pure."""
from __future__ import annotations

from pathlib import Path

from serving.host_programs import Program

HERE = Path(__file__).parent
SYSTEMD_FILE = HERE / "files" / "systemd.sh"
SYSTEMD_PROGRAM = Program((SYSTEMD_FILE,))
FOLDERS_PROGRAM = Program((HERE / "files" / "folders.sh",))
ACTIONS = ("none", "start", "restart", "reload", "stop", "try-restart", "enable", "disable", "remove")


def systemd_parameters(unit: str, action: str = "none", daemon_reload: bool = False, enable: bool = False,
                       remove: tuple = ()) -> dict:
    """The parameters of systemd.sh (a program that ends in it takes them too)."""
    if action not in ACTIONS:
        raise ValueError(f"systemctl action {action!r} is not one of {', '.join(ACTIONS)}")
    return {"UNIT": unit, "ACTION": action, "DAEMON_RELOAD": int(daemon_reload), "ENABLE": int(enable),
            "REMOVE": "\n".join(remove)}


def systemctl(unit: str, action: str = "none", daemon_reload: bool = False, enable: bool = False,
              remove: tuple = ()) -> str:
    """The script that tells ``unit`` ``action`` (after a daemon-reload, and enabling it, when asked)."""
    return SYSTEMD_PROGRAM.script(systemd_parameters(unit, action, daemon_reload, enable, remove))


def folders_script(*paths: str, mode: str = "-", owner: str = "-", group: str = "-") -> str:
    """The script that makes ``paths`` where missing: with ``mode`` and owner, or as mkdir -p does."""
    return FOLDERS_PROGRAM.script({"FOLDERS": "\n".join(f"{mode} {owner} {group} {path}" for path in paths)})
