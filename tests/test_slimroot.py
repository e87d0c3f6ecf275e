"""The lab's small image roots (lab/slimroot.py): symlinks on the way made again, programs
with every library they link, so that they run in a root of their own."""
import os
import subprocess
from pathlib import Path

import pytest

from lab import sh
from lab.slimroot import SlimRoot


def test_symlinks_on_the_way_are_made_again_relative_and_absolute(tmp_path):
    base, root = tmp_path / "base", tmp_path / "root"
    (base / "usr/lib/b").mkdir(parents=True)
    (base / "usr/lib/b/x.so.1").write_text("x")
    (base / "usr/lib/a").mkdir()
    (base / "usr/lib/a/x.so").symlink_to("../b/x.so.1")
    (base / "lib").symlink_to("usr/lib")
    (base / "etc").mkdir()
    (base / "etc/os-release").symlink_to("/usr/lib/os-release")
    (base / "usr/lib/os-release").write_text("ID=debian\n")
    slim = SlimRoot(base, root)
    assert slim.path("/lib/a/x.so") == base / "usr/lib/b/x.so.1"
    assert os.readlink(root / "lib") == "usr/lib" and os.readlink(root / "usr/lib/a/x.so") == "../b/x.so.1"
    assert (root / "lib/a/x.so").read_text() == "x"
    slim.path("/etc/os-release")
    # an absolute link stays absolute (it points inside the image), its target copied
    assert os.readlink(root / "etc/os-release") == "/usr/lib/os-release"
    assert (root / "usr/lib/os-release").read_text() == "ID=debian\n"
    assert sorted(p.name for p in (root / "usr/lib").iterdir()) == ["a", "b", "os-release"]  # nothing else
    with pytest.raises(sh.LabError, match="/usr/lib/c: not in the base"):
        slim.path("/usr/lib/c")


@pytest.mark.skipif(os.geteuid() != 0, reason="chroot needs root (./run.sh test runs as root)")
def test_a_shell_copied_with_its_libraries_runs_in_a_root_of_its_own(tmp_path):
    slim = SlimRoot(Path("/"), tmp_path / "root")
    for program in ("/usr/bin/dash", "/usr/bin/uname"):
        slim.program(program)
    slim.path("/bin/sh")
    out = subprocess.run(["chroot", str(tmp_path / "root"), "/bin/sh", "-c", "uname -m; echo $0"],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.split() == [os.uname().machine, "/bin/sh"], out.stderr
    # no more than the programs and what they link: libc and the loader, here
    files = [p for p in (tmp_path / "root").rglob("*") if p.is_file() and not p.is_symlink()]
    assert 3 < len(files) < 10, files
