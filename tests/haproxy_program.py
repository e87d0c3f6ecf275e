"""The HAProxy the tests run: Debian 13's HAProxy 3.0 LTS package under its own loader and
libraries (lab/haproxy_package.py), the binary the lab's front door image carries. `./run.sh
test` unpacks it; `invoke lab.haproxy` does the same by hand."""
from __future__ import annotations

import functools

import pytest

from lab import haproxy_package


@functools.cache
def _version() -> str | None:
    return haproxy_package.installed()


def haproxy() -> str:
    """The program's path; the test fails, saying how to get it, when it is not there."""
    if _version() is None:
        pytest.fail(f"HAProxy {haproxy_package.BRANCH} is not unpacked at {haproxy_package.binary()}: "
                    f"./run.sh test does it (or: invoke lab.haproxy)")
    return str(haproxy_package.binary())
