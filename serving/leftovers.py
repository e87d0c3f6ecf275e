"""What a role left on a host that is no longer in its group, removed (serving/gateway_leftovers.py,
serving/monitoring_leftovers.py): one program for both, files/leftovers_removed.sh, and how
its end is read."""
from __future__ import annotations

from pathlib import Path

from converge.changes import Command
from converge.errors import StepFailed

from serving.host_programs import Program

PROGRAM = Program((Path(__file__).parent / "files" / "leftovers_removed.sh",))


def script(units, files, folders, shared_unit: str = "", shared_conf: str = "", shared_check: str = "",
           ours: str = "") -> str:
    """The program with these units, files and folders (and the shared address's unit,
    configuration and check script to give up when the configuration is ours)."""
    return PROGRAM.script({"UNITS": "\n".join(units), "FILES": "\n".join(files), "FOLDERS": "\n".join(folders),
                           "SHARED_UNIT": shared_unit, "SHARED_CONF": shared_conf, "SHARED_CHECK": shared_check,
                           "OURS": ours})


def still_there(facts, names) -> bool:
    """Whether any of the facts ``names`` (UnitState) finds its unit still loaded."""
    return any(((facts or {}).get(name) or {}).get("LoadState") == "loaded" for name in names)


def removal(name: str, script: str, describe: str, done: str) -> Command:
    """The step that runs the program (``script``), says ``done`` when it ended well and fails
    with what the host said when not."""
    return Command(name, script=script, describe=describe, interpret=lambda result: removed(result, done))


def removed(result, done: str) -> str:
    """``done`` when the program ended well; else the step fails with what the host said."""
    if not result.ok:
        tail = (result.stdout + result.stderr).strip()[-400:]
        raise StepFailed(f"the removal stopped (exit {result.rc}): {tail or 'it printed nothing'}; deploy again "
                         f"to finish it (what is gone stays gone)")
    return done
