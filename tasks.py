"""Invoke tasks, by domain, each a thin function over the library (cli/):

    invoke inventory.check | facts | deploy | verify | trust | render      cli/deploy.py
    invoke status | start | stop | restart | recover | logs | endpoints | bench     cli/day2.py
    invoke keys.add | keys.revoke | keys.list                                      cli/keys.py
    invoke lab.up | lab.status | lab.down | lab.gpu | lab.uplink | lab.hub | lab.image   lab/tasks.py

Deploy's and day 2's tasks keep their short names at the top (``invoke deploy``,
``invoke restart``); the keys and the lab are collections of their own.
"""
from __future__ import annotations

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


ns = _merged(deploy.ns, day2.ns)
ns.add_collection(keys.ns, name="keys")

try:  # the lab is added when its package is present (a user's copy may leave it out)
    from lab import tasks as lab_tasks
    ns.add_collection(lab_tasks.ns, name="lab")
except ImportError as exc:  # pragma: no cover
    if "lab" not in str(exc):
        raise
