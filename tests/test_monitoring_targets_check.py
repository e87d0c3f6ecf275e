"""verify's check that every target Prometheus knows answers (roles/monitoring/tests), on
Prometheus's own answers: a target last found down is judged on its next scrape, within its
interval and timeout, and a target still down then is named."""
import json
from types import SimpleNamespace

import pytest

import roles.monitoring.tests.test_monitoring as checks


def _target(health: str, scraped: str, error: str = "") -> dict:
    return {"scrapeUrl": "http://spark01:9100/metrics", "labels": {"job": "node", "host": "spark01"},
            "health": health, "lastScrape": scraped, "lastError": error, "scrapeInterval": "15s",
            "scrapeTimeout": "10s"}


class Prometheus:
    """A host whose curl of /api/v1/targets gives each answer in turn (the last from then on)."""

    def __init__(self, *answers):
        self.answers, self.asked = list(answers), 0

    def run(self, command: str):
        assert "'http://127.0.0.1:9090/api/v1/targets?state=active'" in command, command
        answer = self.answers[min(self.asked, len(self.answers) - 1)]
        self.asked += 1
        return SimpleNamespace(stdout=json.dumps({"status": "success", "data": {"activeTargets": answer}}))


@pytest.fixture
def clock(monkeypatch):
    """Prometheus's scrapes come as the check sleeps: a second of the fake clock a sleep."""
    now = {"t": 0.0}
    monkeypatch.setattr(checks.time, "monotonic", lambda: now["t"])
    monkeypatch.setattr(checks.time, "sleep", lambda s: now.update(t=now["t"] + s))
    return now


def test_a_target_down_at_its_last_scrape_and_up_at_its_next_passes(clock):
    before = _target("down", "T1", "server returned HTTP status 503 Service Unavailable")
    host = Prometheus([before], [before], [_target("up", "T2")])
    checks.test_every_target_prometheus_knows_answers(host, {"prometheus_port": 9090})
    assert host.asked == 3 and clock["t"] == 2


def test_a_target_still_down_at_its_next_scrape_is_named():
    host = Prometheus([_target("down", "T1", "503")], [_target("down", "T2", "connection refused")])
    with pytest.raises(AssertionError, match=r"node on spark01 \(connection refused\)"):
        checks.test_every_target_prometheus_knows_answers(host, {"prometheus_port": 9090})


def test_a_target_never_scraped_again_fails_after_its_interval_and_timeout(clock):
    host = Prometheus([_target("down", "T1", "503")])
    with pytest.raises(AssertionError, match=r"node on spark01 \(503\)"):
        checks.test_every_target_prometheus_knows_answers(host, {"prometheus_port": 9090})
    assert clock["t"] == 30  # 15 s + 10 s + 5 s


def test_every_target_up_asks_once(clock):
    host = Prometheus([_target("up", "T1"), {**_target("unknown", ""), "scrapeUrl": "http://new:9100/metrics"}])
    checks.test_every_target_prometheus_knows_answers(host, {"prometheus_port": 9090})
    assert host.asked == 1 and clock["t"] == 0


@pytest.mark.parametrize("duration, seconds", [("15s", 15), ("1m", 60), ("1m30s", 90), ("500ms", 0.5), ("2h", 7200)])
def test_prometheus_durations(duration, seconds):
    assert checks._seconds(duration) == seconds
