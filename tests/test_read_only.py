"""A check writes nothing on the control machine: what a deploy would make there (the fleet
CA, a host's certificate, the gateway's and the monitoring hosts' keys) is held in memory for
the run and said ("would make ..."); the deploy makes it (the lab test of `deploy --check`
against a fresh credentials_dir checks the same end to end)."""
import os

from tests import plans

CASES = ["frontdoor/fresh-host", "gateway/fresh-host", "monitoring/fresh-monitor01"]


def _tree(folder) -> dict:
    return {os.path.join(d, f): os.stat(os.path.join(d, f)).st_mtime_ns for d, _, files in os.walk(folder) for f in files}


def test_a_check_against_a_fresh_credentials_folder_makes_nothing_and_says_what_a_deploy_would(tmp_path):
    fresh = tmp_path / "credentials"
    for name in CASES:
        done = plans.run(plans.load(plans.HERE / "cases" / f"{name}.json"), credentials_dir=str(fresh))
        said = [t.message for t in done.report.tasks if t.task == "fleet credentials"]
        assert said and said[0].startswith("would make the fleet CA in") and "nothing was written" in said[0], \
            (name, said)
        assert not fresh.exists(), f"{name}: a check made {sorted(_tree(fresh))}"
        # planned all the same, with what a deploy would make (the front door's files, its generation)
        assert not [t for t in done.report.tasks if t.status == "failed"], (name, done.report.tasks)
    keys = [t.message for t in plans.run(plans.load(plans.HERE / "cases" / "gateway/fresh-host.json"),
                                         credentials_dir=str(fresh)).report.tasks if t.task == "fleet credentials"][0]
    assert "the gateway key" in keys and "the monitoring key" in keys


def test_a_check_reads_the_credentials_there_and_touches_none(tmp_path):
    copy = plans.credentials(str(tmp_path))
    before = _tree(copy)
    for name in CASES:
        done = plans.run(plans.load(plans.HERE / "cases" / f"{name}.json"), credentials_dir=copy)
        assert not [t for t in done.report.tasks if t.task == "fleet credentials"]
    assert _tree(copy) == before  # not even the lock file
