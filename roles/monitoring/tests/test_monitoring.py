"""The monitoring host as deployed: Prometheus and Alertmanager running on loopback alone,
with the configuration deploy wrote loaded, their secrets the containers' user's alone,
and every target Prometheus knows of answering."""
import json
import re
import shlex
import time

import pytest


@pytest.fixture
def monitoring(expected):
    return expected["monitoring"]


def test_prometheus_and_alertmanager_run_and_start_at_boot(host, monitoring, fix):
    for unit in (monitoring["prometheus"], monitoring["alertmanager"]):
        service = host.service(unit)
        assert service.is_running and service.is_enabled, f"{unit} is not running or not enabled; {fix}"


def test_they_listen_on_loopback_alone_and_load_their_configuration(host, monitoring, fix):
    for kind, port in (("prometheus", monitoring["prometheus_port"]), ("alertmanager", monitoring["alertmanager_port"])):
        assert host.run(f"curl -sf -o /dev/null --max-time 5 http://127.0.0.1:{port}/-/ready").rc == 0, \
            f"{kind} is not ready on 127.0.0.1:{port}; {fix}"
        listening = host.run(f"ss -Hltn 'sport = :{port}'").stdout.split()
        assert [a for a in listening if a.endswith(f":{port}")] == [f"127.0.0.1:{port}"], \
            f"{kind} listens beyond loopback ({listening}); {fix}"
        metrics = host.run(f"curl -s --max-time 5 http://127.0.0.1:{port}/metrics").stdout
        assert f"{kind}_config_last_reload_successful 1" in metrics, \
            f"{kind} did not load the configuration deploy wrote; {fix} (journalctl -u {monitoring[kind]} says why)"


def test_the_monitoring_key_is_the_containers_users_alone(host, monitoring, fix):
    for path in monitoring["secrets"]:
        f = host.file(path)
        assert f.exists and f.mode == 0o400 and f.uid == 65534, f"{path}: mode {oct(f.mode)}, uid {f.uid}; {fix}"


def test_every_target_prometheus_knows_answers(host, monitoring):
    """Judged on each target's latest scrape. One Prometheus last found down is judged on its next:
    that last scrape may be from before a deploy had its exporter up (seen on a cold lab: spark01's
    node exporter, starting under qemu, 503 through its front door a few seconds before it answered)."""
    url = f"http://127.0.0.1:{monitoring['prometheus_port']}/api/v1/targets?state=active"

    def targets() -> list[dict]:
        return json.loads(host.run(f"curl -s --max-time 10 {shlex.quote(url)}").stdout)["data"]["activeTargets"]

    def name(t: dict) -> tuple:
        return t["scrapeUrl"], t["labels"].get("job"), t["labels"].get("host")

    now = targets()
    assert now, "Prometheus knows no target yet"
    seen = {name(t): t["lastScrape"] for t in now if t["health"] == "down"}  # "unknown": not scraped yet (a new target)
    # each down target's next scrape comes within its interval and its timeout
    deadline = time.monotonic() + 5 + max((_seconds(t["scrapeInterval"]) + _seconds(t["scrapeTimeout"])
                                           for t in now if name(t) in seen), default=0)
    while any(seen.get(name(t)) == t["lastScrape"] for t in now) and time.monotonic() < deadline:
        time.sleep(1)
        now = targets()
    down = [f"{t['labels'].get('job')} on {t['labels'].get('host')} ({t.get('lastError') or t['health']})"
            for t in now if t["health"] == "down"]
    assert not down, f"not answering Prometheus: {'; '.join(down)}; see: invoke status"


def _seconds(duration: str) -> float:
    """A Prometheus duration as it prints one (15s, 1m, 1m30s, 500ms) in seconds."""
    units = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400}
    return sum(float(n) * units[unit] for n, unit in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", duration))
