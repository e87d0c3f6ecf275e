"""Invoke tasks, by domain, each a thin function over the library (cli/):

    invoke inventory.check | facts | deploy | verify | trust | render      cli/deploy.py
    invoke status | start | stop | restart | recover | logs | endpoints | bench     cli/day2.py
    invoke keys.add | keys.revoke | keys.list                                      cli/keys.py
    invoke lab.up | lab.status | lab.down | lab.gpu | lab.uplink | lab.hub | lab.image   lab/tasks.py

Deploy's and day 2's tasks keep their short names at the top (``invoke deploy``,
``invoke restart``); the keys and the lab are collections of their own.
"""
from __future__ import annotations

import os
import sys

from invoke import Collection

from cli import day2, deploy, keys


def _merged(*collections: Collection) -> Collection:
    """One collection holding each one's tasks at its top and its sub-collections."""
    root = Collection()
    for collection in collections:
        for name, task in collection.tasks.items():
            root.add_task(task, name)
        for name, sub in collection.collections.items():
            root.add_collection(sub, name)
    return root


def _quiet_on_a_closed_pipe(kind, value, traceback):
    """A reader that stops reading (`invoke top --once | head -n 2`) ends the command quietly, as a
    Unix tool ends (exit 141, SIGPIPE's), not with a traceback. Standard output goes to /dev/null
    first, so that Python's last flush at exit has nowhere to fail. SIGPIPE itself stays ignored:
    a host's connection that closes must be an error the engine reports, not a signal that kills."""
    if issubclass(kind, BrokenPipeError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, sys.stdout.fileno())
        sys.exit(141)
    sys.__excepthook__(kind, value, traceback)


sys.excepthook = _quiet_on_a_closed_pipe

ns = _merged(deploy.ns, day2.ns)
ns.add_collection(keys.ns, name="keys")

try:  # the lab is added when its package is present (a user's copy may leave it out)
    from lab import tasks as lab_tasks
    ns.add_collection(lab_tasks.ns, name="lab")
except ImportError as exc:  # pragma: no cover
    if "lab" not in str(exc):
        raise
