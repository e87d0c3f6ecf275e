"""The reference pages are made from the code, never by hand (reference/build.py): each is what
`python3 -m reference.build` writes now, so a key or a task added, changed or removed without
writing them again fails here; and they name every inventory key and every task."""
import re

import pytest

from reference import build
from tests.conftest import ROOT


@pytest.mark.parametrize("name", ["inventory.md", "tasks.md"])
def test_the_reference_is_what_the_code_declares(name):
    written = (ROOT / "docs" / "reference" / name).read_text()
    assert written == build.render()[name], f"docs/reference/{name} is stale: run python3 -m reference.build"


def test_every_inventory_key_and_every_task_is_named():
    page = (ROOT / "docs" / "reference" / "inventory.md").read_text()
    named = set(re.findall(r"^### `([^`]+)`$", page, re.M))
    for reader, where, schema, _ in build.schema_sources():
        missing = set(schema.get("properties") or {}) - named
        assert not missing, (where, missing)
    assert {"diffusion_entropy_bound", "api_key_file", "ansible_host", "key_limits", "kubernetes.namespace"} <= named
    tasks = (ROOT / "docs" / "reference" / "tasks.md").read_text()
    import tasks as tasks_module
    for task in tasks_module.ns.task_names:
        assert f"## `invoke {task}`" in tasks, task
    assert "`--bounds`, `-b`" in tasks and "## `invoke tune`" in tasks
