"""serving/files/systemd.sh and serving/files/folders.sh run for real under dash: systemctl a stand-in that
writes down what it was asked; folders made in a test's own folder."""
import os
import subprocess

import pytest

from serving.systemd import folders_script, systemctl

SYSTEMCTL = '#!/bin/sh\necho "$*" >> "$CALLS"\n'


def _run(script: str, tmp_path) -> tuple[int, list[str]]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "systemctl").write_text(SYSTEMCTL)
    (bin_dir / "systemctl").chmod(0o755)
    calls = tmp_path / "calls"
    calls.write_text("")
    proc = subprocess.run(["dash", "-c", script], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls)})
    return proc.returncode, calls.read_text().splitlines()


@pytest.mark.parametrize("kwargs, said", [
    (dict(action="start", daemon_reload=True, enable=True),
     ["daemon-reload", "enable u.service", "reset-failed u.service", "start u.service"]),
    (dict(action="restart"), ["reset-failed u.service", "restart u.service"]),
    (dict(action="try-restart"), ["try-restart u.service"]),
    (dict(action="disable", daemon_reload=True), ["daemon-reload", "disable u.service"]),
    (dict(daemon_reload=True), ["daemon-reload"]),
])
def test_systemd_is_told_what_the_role_asked(tmp_path, kwargs, said):
    rc, calls = _run(systemctl("u.service", **kwargs), tmp_path)
    assert (rc, calls) == (0, said)


def test_a_removed_unit_is_stopped_and_its_files_go_even_those_with_blanks_and_quotes(tmp_path):
    kept, gone = tmp_path / "kept.conf", [tmp_path / "a.conf", tmp_path / "it's a check"]
    for path in (kept, *gone):
        path.write_text("x")
    rc, calls = _run(systemctl("k.service", "remove", remove=tuple(str(p) for p in gone)), tmp_path)
    assert (rc, calls) == (0, ["disable --now k.service"])
    assert kept.exists() and not any(p.exists() for p in gone)


def test_an_action_not_declared_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match="not one of"):
        systemctl("u.service", "kill")


def test_folders_are_made_with_their_mode_and_one_there_is_left_as_it_is(tmp_path):
    there = tmp_path / "there"
    there.mkdir(mode=0o700)
    made = [tmp_path / "a" / "b", tmp_path / "with blank"]
    rc, _ = _run(folders_script(str(there), *map(str, made)), tmp_path)
    assert rc == 0 and all(p.is_dir() for p in made) and (there.stat().st_mode & 0o777) == 0o700
    owned = tmp_path / "owned"
    rc, _ = _run(folders_script(str(owned), mode="0750", owner=str(os.getuid()), group=str(os.getgid())), tmp_path)
    assert rc == 0 and (owned.stat().st_mode & 0o777) == 0o750


def test_a_folder_that_cannot_be_made_fails_the_program(tmp_path):
    (tmp_path / "file").write_text("x")
    rc, _ = _run(folders_script(str(tmp_path / "file" / "under")), tmp_path)
    assert rc == 1
