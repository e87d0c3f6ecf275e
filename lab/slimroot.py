"""The root of a small image, copied out of a base rootfs: programs, the libraries their ELF
headers name (and theirs), and whole trees, each at its path in the base, with the base's
symlinks on the way (merged /usr: /lib -> usr/lib) made again as symlinks.

Why small: a lab host pulls and unpacks each image it runs, and the aarch64 host does it
under qemu-user, where the whole Debian base (364 MB, 10,000 files) took a minute of
Docker's time per image and per pull."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from . import sh

# glibc loads it at run time (thread cancellation and unwinding), so no header names it
DLOPENED = ("libgcc_s.so.1",)


class SlimRoot:
    def __init__(self, base: Path, root: Path):
        self.base, self.root = base, root
        self._seen: set[str] = set()
        root.mkdir(parents=True, exist_ok=True)

    def path(self, inside: str) -> Path:
        """Copy ``inside`` (an absolute path in the base) with the symlinks that lead to it;
        returns the real file or folder in the base that it names."""
        parts = [p for p in inside.split("/") if p]
        done: list[str] = []
        while parts:
            name = parts.pop(0)
            rel = "/".join(done + [name])
            source = self.base / rel
            if source.is_symlink():
                target = os.readlink(source)
                link = self.root / rel
                if not link.is_symlink():
                    link.parent.mkdir(parents=True, exist_ok=True)
                    link.symlink_to(target)
                # go on from where the link points, inside the base
                parts = _normal(([] if target.startswith("/") else done) + target.split("/")) + parts
                done = []
                continue
            if not source.exists():
                raise sh.LabError(f"{inside}: not in the base {self.base}")
            if not parts:
                dest = self.root / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if source.is_dir():
                    shutil.copytree(source, dest, symlinks=True, dirs_exist_ok=True)
                elif not dest.exists():
                    shutil.copy2(source, dest)
                return source
            done = _normal(done + [name])
        return self.base

    def program(self, inside: str, source: Path | None = None) -> None:
        """``inside`` and every library its ELF header names, recursively; ``source``: the
        program's file where the base lacks it (a package unpacked beside it)."""
        if source is None:
            wanted = [self.path(inside)]
        else:
            dest = self.root / inside.lstrip("/")
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest)
            wanted = [source]
        # once per root, as any library: not again for each program
        wanted += [self.path(found) for found in (self._needed(name, "glibc") for name in DLOPENED) if found]
        while wanted:
            elf = wanted.pop()
            header = sh.run("readelf", "-d", "-l", elf).stdout
            names = [line.split("[", 1)[1].split("]", 1)[0] for line in header.splitlines() if "(NEEDED)" in line]
            names += [line.split(":", 1)[1].strip(" ]\n") for line in header.splitlines()
                      if "Requesting program interpreter" in line]
            wanted += [self.path(found) for found in (self._needed(name, elf) for name in names) if found]

    def _needed(self, name: str, by) -> str | None:
        """Where the base has library ``name`` (None: already copied into this root)."""
        if name in self._seen:
            return None
        self._seen.add(name)
        found = name if name.startswith("/") else self._library(name)
        if found is None:
            raise sh.LabError(f"{by} needs {name}, which the base {self.base} lacks")
        return found

    def _library(self, name: str) -> str | None:
        for folder in ("/usr/lib", "/lib"):
            for arch_dir in sorted((self.base / folder.lstrip("/")).glob("*-linux-gnu")):
                if (arch_dir / name).exists():
                    return f"{folder}/{arch_dir.name}/{name}"
            if (self.base / folder.lstrip("/") / name).exists():
                return f"{folder}/{name}"
        return None

    def extension_modules(self, folder: str) -> None:
        """Every shared object under ``folder`` (already copied) and what it links."""
        for so in sorted((self.base / folder.lstrip("/")).rglob("*.so")):
            self.program("/" + str(so.relative_to(self.base)))

    def file(self, inside: str, text: str, mode: int = 0o644) -> None:
        dest = self.root / inside.lstrip("/")
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
        dest.chmod(mode)

    def folder(self, inside: str, mode: int = 0o755) -> None:
        dest = self.root / inside.lstrip("/")
        dest.mkdir(parents=True, exist_ok=True)
        dest.chmod(mode)


def _normal(parts: list[str]) -> list[str]:
    out: list[str] = []
    for part in parts:
        if part in ("", "."):
            continue
        if part == "..":
            if out:
                out.pop()
        else:
            out.append(part)
    return out
