"""One lab command at a time (lab/lock.py): a second lab.up or lab.down while one runs is refused
at once, naming the first; the lock goes with the command."""
import pytest

from lab import config, lock
from lab.sh import LabError


def test_a_second_lab_command_is_refused_naming_the_first_and_the_lock_goes_with_it(tmp_path, monkeypatch):
    monkeypatch.setattr(config, "STATE", tmp_path / "state")
    with lock.held("lab.up"):
        with pytest.raises(LabError, match=r"invoke lab\.up \(pid [0-9]+\) is running on this lab now .*"
                                            r"then run lab\.down again"):
            with lock.held("lab.down"):
                pass
    with lock.held("lab.down"):  # free again
        pass
