"""HAProxy 3.0 LTS from Debian 13's package, with the libraries it links and Debian 13's
loader, unpacked for one arch: the lab's front door image (library/haproxy:3.0) is built
from it, and the tests and benchmarks run this same binary on this machine (Debian 12,
whose own package is HAProxy 2.6, out of HAProxy's support in 2027).

Nothing is installed: apt reads Debian 13's lists into a folder of its own (signatures
checked against this machine's Debian keyring), ``apt-get download`` fetches the packages,
``dpkg-deb -x`` unpacks them. On this machine the binary runs under the unpacked loader
with the unpacked libraries (``program()``: a small script); in the image those are its
libraries."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from . import config, debs, sh

SUITE = "trixie"
BRANCH = "3.0"
# the package and the libraries it links, with theirs (apt-cache depends of Debian 13, less
# what a binary never loads: adduser, init-system-helpers, lsb-base, sysvinit-utils)
PACKAGES = ["haproxy", "libc6", "libcrypt1", "libjemalloc2", "liblua5.4-0", "libopentracing-c-wrapper0t64",
            "libopentracing1", "libpcre2-8-0", "libssl3t64", "libgcc-s1", "libstdc++6", "libzstd1", "zlib1g"]
TRIPLET = {"x86_64": "x86_64-linux-gnu", "aarch64": "aarch64-linux-gnu"}
LOADER = {"x86_64": "usr/lib64/ld-linux-x86-64.so.2", "aarch64": "usr/lib/ld-linux-aarch64.so.1"}
HOME = config.CACHE / f"haproxy-{BRANCH}"

# the program on this machine: the package's binary under the package's loader and libraries.
# --argv0 is this script, so that a master-worker reload (which executes its argv[0] again)
# comes back through it
WRAPPER = """#!/bin/sh
# HAProxy {branch} from Debian 13's package (lab/haproxy_package.py): its binary, its loader, its libraries
root="$(dirname "$(readlink -f "$0")")/root"
exec "$root/{loader}" --library-path "$root/usr/lib/{triplet}" --argv0 "$0" "$root/usr/sbin/haproxy" "$@"
"""


# Debian 13's lists, both arches, in a folder of their own
LISTS = debs.Lists(HOME / "apt", SUITE, ("amd64", "arm64"))
READING = f"Debian 13's package lists for HAProxy {BRANCH}"


def ensure(arch: str, log=print) -> Path:
    """The unpacked packages for ``arch`` (its folder holds usr/ as the packages lay it out),
    downloaded once and cached."""
    target = HOME / arch / "root"
    done = HOME / arch / "root.done"
    if done.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    suffix = "" if arch == os.uname().machine else f":{config.DEB_ARCH[arch]}"
    names = [name + suffix for name in PACKAGES]
    LISTS.read_once(READING, log)
    log(f"unpacking Debian 13's HAProxy {BRANCH} for {arch} ({len(names)} packages, not installed)")
    debs.download_unpacked(names, target, HOME / arch / "download", lambda: LISTS.read(READING, log), LISTS.options())
    if not (target / "usr/sbin/haproxy").exists() or not (target / LOADER[arch]).exists():
        raise sh.LabError(f"Debian 13's packages unpacked in {target} lack usr/sbin/haproxy or {LOADER[arch]}")
    done.touch()
    return target


def program(log=print) -> Path:
    """The HAProxy 3.0 program of this machine's arch: unpacked if not yet, and checked to run."""
    arch = os.uname().machine
    ensure(arch, log)
    wrapper = binary()
    text = WRAPPER.format(branch=BRANCH, loader=LOADER[arch], triplet=TRIPLET[arch])
    if not wrapper.exists() or wrapper.read_text() != text:
        partial = wrapper.with_suffix(".partial")
        partial.write_text(text)
        partial.chmod(0o755)
        partial.replace(wrapper)
    version = installed()
    if version is None:
        raise sh.LabError(f"{wrapper} does not run: remove {wrapper.parent} and run `invoke lab.haproxy` again")
    return wrapper


def installed() -> str | None:
    """The first line of ``haproxy -v`` of the program here, or None when it is not (yet) there."""
    wrapper = binary()
    if not wrapper.exists():
        return None
    proc = subprocess.run([str(wrapper), "-v"], capture_output=True, text=True, timeout=60)
    first = proc.stdout.splitlines()[0] if proc.stdout else ""
    return first if proc.returncode == 0 and first.startswith(f"HAProxy version {BRANCH}.") else None


def binary() -> Path:
    """Where ``program()`` puts the program of this machine's arch (it may not be there yet)."""
    return HOME / os.uname().machine / "haproxy"
