import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "fixtures"


def standin_on_path(tmp_path: Path, profile: str, state: str = "{}\n") -> dict:
    """An environment whose `nvidia-smi` is the lab's stand-in (lab/stubs/nvidia-smi) with
    lab/profiles/<profile>.json and this state, as this machine's nvidia-smi."""
    import os
    stub = tmp_path / "stub"
    stub.mkdir()
    (stub / "profile.json").write_text((ROOT / "lab" / "profiles" / f"{profile}.json").read_text())
    (stub / "state.json").write_text(state)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    wrapper = bindir / "nvidia-smi"
    wrapper.write_text(f"#!/bin/sh\nNVIDIA_STUB_DIR={stub} NVIDIA_STUB_APPS={stub}/apps "
                       f"NVIDIA_STUB_VISIBLE={tmp_path}/none exec {sys.executable} "
                       f"{ROOT / 'lab' / 'stubs' / 'nvidia-smi'} \"$@\"\n")
    wrapper.chmod(0o755)
    return dict(os.environ, PATH=f"{bindir}:{os.environ['PATH']}", COLUMNS="200")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """With pytest-xdist (`run.sh test` passes `-n 2`): the lab tests share one deployed lab,
    so they go, in their order, to one worker, as one unit of work; the unit tests run on the
    other worker meanwhile, in what the lab leaves of this machine's cores."""
    if config.getvalue("dist") != "load":
        return None  # a --dist asked for by name is pytest-xdist's own
    from xdist.scheduler import LoadScopeScheduling

    class LabTestsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "lab" if nodeid.startswith("tests/lab/") else nodeid

    return LabTestsTogether(config, log)


# A unit test that only computes gets this CPU priority while the lab's tests run on the other
# worker: the suite lasts as long as the lab's tests, one after another, and at the same priority
# such a test took half the cores from the lab's first deploys (under qemu, CPU-bound); lowered,
# it runs in what the lab leaves idle (its waits). Tests that keep time (servers, timeouts, a
# pace) stay at the lab's priority: starved, they would fail for want of CPU
LOWEST_PRIORITY = 19


def _beside_the_lab(item) -> bool:
    """Whether ``item`` runs in a pytest-xdist worker of a session that has lab tests, as root
    (who alone may raise a priority back)."""
    session = item.session
    if not hasattr(session, "_beside_the_lab"):
        session._beside_the_lab = (bool(os.environ.get("PYTEST_XDIST_WORKER")) and os.geteuid() == 0
                                   and any(i.nodeid.startswith("tests/lab/") for i in session.items))
    return session._beside_the_lab


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    if item.get_closest_marker("compute_only") and _beside_the_lab(item):
        os.setpriority(os.PRIO_PROCESS, 0, LOWEST_PRIORITY)


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item):
    if item.get_closest_marker("compute_only") and _beside_the_lab(item):
        os.setpriority(os.PRIO_PROCESS, 0, 0)


def pytest_sessionfinish(session, exitstatus):
    """docs/RELIABILITY.md from what the fault suite and the fuzz test measured."""
    from tests import reliability
    reliability.write()
