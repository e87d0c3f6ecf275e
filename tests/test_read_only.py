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


def test_what_a_check_would_make_a_deploy_makes_there(tmp_path):
    """The deploy's side of it: the same calls, not in check mode, make the fleet CA, the host's
    certificate and the fleet's keys in the folder, the CA's key root's alone."""
    from credentials import directory
    from credentials.keys import service_key
    from serving.haproxy import tls
    fresh = tmp_path / "credentials"
    v = {"credentials_dir": str(fresh), "ansible_host": "10.213.0.12"}
    tls.bundle("rtx01", v, (), make=True)
    for name in (tls.GATEWAY_KEY, tls.MONITORING_KEY):
        service_key(directory(v), name, make=True)
    made = {str(p.relative_to(fresh)) for p in fresh.rglob("*") if p.is_file()}
    assert {"ca/ca.crt", "ca/ca.key", "hosts/rtx01.crt", "hosts/rtx01.key", "monitoring.key", "gateway.key"} <= made
    assert oct(fresh.stat().st_mode)[-3:] == "700" and (fresh / "ca" / "ca.key").stat().st_mode & 0o077 == 0
