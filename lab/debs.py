"""Debian packages for the lab's images, unpacked rather than installed: downloaded with
``apt-get download`` (with what they depend on, less what the base rootfs has) and
``dpkg-deb -x`` into a folder, cached. Nothing is installed on this machine, and no
service of theirs starts here. Another arch's packages (arm64 on this amd64 machine) come
through package lists of their own in the lab's cache, never this machine's apt setup."""
from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from . import config, sh


def installed_in(root: Path) -> set[str]:
    """The packages a rootfs has (its dpkg status file)."""
    names, name = set(), None
    for line in (root / "var/lib/dpkg/status").read_text(errors="replace").splitlines():
        if line.startswith("Package: "):
            name = line.split(": ", 1)[1].strip()
        elif line.startswith("Status: ") and line.endswith("installed") and name:
            names.add(name)
    return names


def dependencies(packages: list[str], have: set[str], apt: list[str] = ()) -> list[str]:
    """The packages and, recursively, what they need that ``have`` lacks: of alternatives
    (``a | b``), none when one is had, else the first; no recommends, no virtual packages.
    ``apt``: apt's options (another arch's lists)."""
    wanted, queue = [], list(packages)
    while queue:
        package = queue.pop(0)
        if package in wanted or package in have:
            continue
        wanted.append(package)
        out = sh.run("apt-cache", *apt, "depends", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
                     "--no-replaces", "--no-enhances", package).stdout
        group: list[str] = []
        for line in out.splitlines():
            field = line.strip()
            if not field.lstrip("|").startswith(("Depends:", "PreDepends:")):
                continue
            group.append(field.split(":", 1)[1].strip())
            if field.startswith("|"):
                continue  # more alternatives follow
            choices = [name for name in group if not name.startswith("<")]
            if choices and not any(name in have or name in wanted for name in choices):
                queue.append(choices[0])
            group = []
    return wanted


def _download(names: list[str], where: Path, apt: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(["apt-get", *apt, "download", *names], cwd=where, capture_output=True, text=True,
                          timeout=900)


def download_unpacked(names: list[str], target: Path, downloads: Path, refresh, apt: list[str] = ()):
    """``names`` downloaded (``apt``: apt's options, e.g. another suite's lists) into ``downloads``,
    the lists refreshed once by ``refresh()`` when a package is not found (lists older than the
    mirror's pool), then each unpacked with ``dpkg-deb -x`` into ``target``; ``downloads`` removed."""
    shutil.rmtree(downloads, ignore_errors=True)
    downloads.mkdir(parents=True)
    if _download(names, downloads, list(apt)).returncode != 0:
        refresh()
        proc = _download(names, downloads, list(apt))
        if proc.returncode != 0:
            raise sh.LabError(f"apt-get download {' '.join(names)} failed: {(proc.stdout + proc.stderr)[-1500:]}")
    target.mkdir(parents=True)
    for deb in sorted(downloads.glob("*.deb")):
        sh.run("dpkg-deb", "-x", deb, target, timeout=300)
    shutil.rmtree(downloads)


@dataclass(frozen=True)
class Lists:
    """A suite's package lists for some arches, read into a folder of their own (``home``, in the
    lab's cache), never this machine's apt setup; signatures checked against this machine's
    keyring. ``architecture``: the arch a package name without one means (None: this machine's)."""
    home: Path
    suite: str
    arches: tuple[str, ...]  # Debian's names: amd64, arm64
    architecture: str | None = None

    def options(self) -> list[str]:
        """apt's options that read these lists alone."""
        return ["-o", f"Dir::Etc::SourceList={self.home / 'sources.list'}", "-o", "Dir::Etc::SourceParts=/dev/null",
                "-o", f"Dir::State::Lists={self.home / 'lists'}", "-o", f"Dir::Cache={self.home / 'cache'}",
                "-o", "Dir::State::status=/dev/null",
                *(["-o", f"APT::Architecture={self.architecture}"] if self.architecture else []),
                *(o for arch in self.arches for o in ("-o", f"APT::Architectures::={arch}")),
                "-o", "Debug::NoLocking=1"]

    def read(self, what: str, log=print):
        """``apt-get update`` into ``home``; ``what``: the lists and why, for the log and the error."""
        for folder in ("lists/partial", "cache/archives/partial"):
            (self.home / folder).mkdir(parents=True, exist_ok=True)
        (self.home / "sources.list").write_text(f"deb [arch={','.join(self.arches)}] {config.MIRROR} {self.suite} "
                                                f"main\n")
        log(f"reading {what} ({config.MIRROR} {self.suite})")
        proc = subprocess.run(["apt-get", *self.options(), "update", "-q"], capture_output=True, text=True,
                              timeout=900)
        if proc.returncode != 0 or "W: GPG error" in proc.stderr or "NO_PUBKEY" in proc.stderr:
            raise sh.LabError(f"apt-get update of {what} ({config.MIRROR} {self.suite}) failed: "
                              f"{(proc.stdout + proc.stderr)[-1500:]}\nIs the mirror reachable, and is "
                              f"debian-archive-keyring current (apt-get install debian-archive-keyring)?")

    def read_once(self, what: str, log=print):
        """``read`` unless the lists were read before."""
        if not (self.home / "lists").is_dir():
            self.read(what, log)


def foreign_lists(arch: str) -> Lists:
    """The lab's suite for ``arch`` (a Debian arch name), its lists in the lab's cache."""
    return Lists(config.CACHE / f"apt-{config.SUITE}-{arch}", config.SUITE, (arch,), architecture=arch)


def unpacked(packages: list[str], base: Path, name: str, log=print, arch: str | None = None) -> Path:
    """A folder holding ``packages`` and their dependencies (but those ``base`` has) unpacked,
    as an image's extras, for ``arch`` (a machine name, x86_64 or aarch64; this machine's when
    None); cached under the lab's cache by ``name``."""
    target = config.CACHE / f"debs-{name}"
    done = config.CACHE / f"debs-{name}.done"
    if done.exists():
        return target
    shutil.rmtree(target, ignore_errors=True)
    done.unlink(missing_ok=True)
    if arch is None or arch == os.uname().machine:
        apt, refresh = [], lambda: sh.run("apt-get", "update", "-q", timeout=900)
    else:
        lists, what = foreign_lists(config.DEB_ARCH[arch]), f"Debian's {config.DEB_ARCH[arch]} package lists"
        lists.read_once(what, log)
        apt, refresh = lists.options(), lambda: lists.read(what, log)
    wanted = dependencies(packages, installed_in(base), apt)
    if not wanted:  # the base has them all
        target.mkdir(parents=True)
        done.touch()
        return target
    log(f"downloading Debian's {', '.join(packages)} for the lab's images ({len(wanted)} packages, unpacked, "
        f"not installed)")
    download_unpacked(wanted, target, config.CACHE / f"debs-{name}.download", refresh, apt)
    # the base has merged /usr (/bin is a link to usr/bin): what a package puts in /bin goes there
    for top in ("bin", "sbin", "lib", "lib64"):
        if (target / top).is_dir() and not (target / top).is_symlink():
            sh.run("cp", "-a", f"{target / top}/.", target / "usr" / top)
            shutil.rmtree(target / top)
    done.touch()
    return target
