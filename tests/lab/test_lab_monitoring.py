"""Monitoring on the lab: monitor01 runs Prometheus and Alertmanager (Debian's, under the
official images' names), scraping every host through its front door with the monitoring
key. Under load from 4 clients through the gateways' shared address: every target up and
the request count Prometheus reports agreeing with the clients'; `invoke top` in tmux with
moving numbers for every replica, its JSON as Prometheus says; every dashboard panel with
data; nothing open without the monitoring key; a replica killed and a host's link cut
each alert a webhook on this machine with the command that fixes it, then resolve; a
monitoring host down fails no deploy of the serving hosts."""
import json
import os
import secrets
import shlex
import shutil
import subprocess
import sys
import threading
import time

import pytest
import yaml

from lab import config, sh
from tests import alert_receiver, reliability
from tests.conftest import ROOT
from tests.lab.conftest import ADDRESS, CA_FILE, deploy_json, front_door, invoke, ssh

MONITOR = "monitor01"
CHAT = {"max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
SERVING = ("spark01", "rtx01", "h100-01", "hgx01")
# every replica of the lab: one per host, hgx01 four (DiffusionGemma on 0-1, Gemma 4 on 2-3)
REPLICAS = [("spark01", 0), ("rtx01", 0), ("h100-01", 0)] + [("hgx01", i) for i in range(4)]

INTERVAL_S = 5  # the monitored lab's scrape and rule evaluation interval


def api_key():
    return config.API_KEY_FILE.read_text().strip()


def monitoring_key():
    return (config.CREDENTIALS / "monitoring.key").read_text().strip()


def prometheus(query: str, at: float | None = None) -> list[dict]:
    """An instant query, asked on monitor01 itself (Prometheus listens on its loopback alone)."""
    args = f"--data-urlencode {shlex.quote('query=' + query)}" + (f" --data-urlencode time={at:.3f}" if at else "")
    out = ssh(MONITOR, f"curl -sS --max-time 10 -G {args} http://127.0.0.1:9090/api/v1/query").stdout
    data = json.loads(out)
    assert data["status"] == "success", out[:300]
    return data["data"]["result"]


def targets() -> list[dict]:
    out = ssh(MONITOR, "curl -sS --max-time 10 'http://127.0.0.1:9090/api/v1/targets?state=active'").stdout
    return json.loads(out)["data"]["activeTargets"]


@pytest.fixture(scope="module")
def monitored(lab, tmp_path_factory):
    """The whole lab deployed, Alertmanager sending to a webhook on this machine (its token in a
    0600 file), and Prometheus scraping every target."""
    folder = tmp_path_factory.mktemp("monitoring")
    token = secrets.token_urlsafe(16)
    token_file = folder / "webhook-token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    receiver = alert_receiver.serve(config.GATEWAY, token)
    inventory = folder / "inventory"
    shutil.copytree(lab, inventory)
    group = inventory / "group_vars" / "monitoring.yml"
    data = yaml.safe_load(group.read_text()) or {}
    # a receiver of its own name: Alertmanager's notification log (kept 5 days, by receiver) would
    # take an alert an earlier run's receiver was told of, and never told resolved, as still known
    # every 5 s, not 15: the alerts and counts the tests wait for come three times sooner (the lab's
    # Prometheus has 22 targets; a lab user's monitor01 keeps the defaults)
    data["scrape_interval_s"] = data["evaluation_interval_s"] = INTERVAL_S
    data["alert_receivers"] = [{"name": f"lab-{secrets.token_hex(4)}", "webhook": {
        "url": f"http://{config.GATEWAY}:{receiver.server_address[1]}/alerts", "bearer_token_file": str(token_file)}}]
    group.write_text(yaml.safe_dump(data))
    proc, report = deploy_json(inventory=inventory)
    assert proc.returncode == 0, proc.stdout[-4000:]
    deadline = time.monotonic() + 120
    while True:
        seen = targets()
        down = [(t["labels"].get("job"), t["labels"].get("host")) for t in seen if t["health"] != "up"]
        # 4 serving hosts (front door, node) and 2 gateways (gateway, node), 7 replicas, monitor01's own 3
        if len(seen) >= 22 and not down:
            break
        assert time.monotonic() < deadline, f"targets not all up after 120 s: {down} of {len(seen)}"
        time.sleep(2)
    yield inventory, receiver, token
    receiver.shutdown()
    receiver.server_close()
    # the lab's own monitoring configuration back: no receiver left posting to a closed port
    deploy_json("--hosts", "monitor01")


class Load:
    """4 clients through the gateways' shared address, two asking DiffusionGemma and two Gemma 4
    (every replica of the lab busy), while the ``with`` block lasts: each outcome with when it ended."""

    def __init__(self):
        self.key, self.stop, self.outcomes, self.lock = api_key(), threading.Event(), [], threading.Lock()
        self.threads = []

    def __enter__(self):
        self.stop.clear()
        self.threads = [threading.Thread(target=self._client, args=(m,), daemon=True)
                        for m in ("diffusiongemma", "gemma4") * 2]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(120)

    def _client(self, model):
        while not self.stop.is_set():
            try:
                status, body, _ = front_door("gateway01", "/v1/chat/completions", self.key, dict(CHAT, model=model),
                                             timeout=90, address=config.GATEWAY_ADDRESS)
                result = status if status == 200 else f"{status} {body[:120]!r}"
            except OSError as exc:
                result = f"{type(exc).__name__}: {exc}"
            with self.lock:
                self.outcomes.append((time.time(), result))

    def answered(self) -> int:
        with self.lock:
            return sum(1 for _, result in self.outcomes if result == 200)

    def failed(self) -> list:
        with self.lock:
            return [o for o in self.outcomes if o[1] != 200]


@pytest.fixture(scope="module")
def load(monitored):
    return Load()


def served_so_far() -> dict:
    """Every generation each replica finished, as Prometheus last scraped it."""
    return {(r["metric"]["host"], r["metric"]["replica"]): float(r["value"][1])
            for r in prometheus("sum by (host, replica) (vllm:request_success_total)")}


def scraped_since(moment: float, limit: float = 4 * INTERVAL_S):
    """Wait until Prometheus has scraped every target once since ``moment`` (this machine's
    clock, which the lab's hosts share): a count read then includes all that happened before
    it, a replica restarted just before (a deploy that rolled it) with its new counter too."""
    deadline = time.monotonic() + limit
    while True:
        late = sorted((t["labels"].get("job"), t["labels"].get("host"), t["labels"].get("replica"), t["lastScrape"])
                      for t in targets() if _epoch(t["lastScrape"]) <= moment)
        if not late:
            return
        assert time.monotonic() < deadline, f"not scraped in {limit} s since {moment:.1f}: {late}"
        time.sleep(1)


def _epoch(rfc3339: str) -> float:
    """Prometheus's lastScrape (RFC 3339, nanoseconds, its host's zone) as seconds since the epoch."""
    from datetime import datetime
    whole, _, rest = rfc3339.partition(".")
    fraction = "".join(ch for ch in rest if ch.isdigit())
    zone = rest[len(fraction):] if rest else whole[19:]
    return datetime.fromisoformat(whole[:19] + zone.replace("Z", "+00:00")).timestamp() + float(f"0.{fraction or 0}")


SCRAPED = INTERVAL_S + 1  # seconds: every target scraped once more


def tmux(*args, check=True):
    return subprocess.run(["tmux", "-L", "dgemma-top", *args], capture_output=True, text=True, check=check)


def test_prometheus_counts_what_the_clients_sent_and_top_shows_every_replica_moving(monitored, load, tmp_path):
    """The generations Prometheus counts for a burst of load (the counters scraped with the fleet
    quiet before and after it) against the clients' answers: within 10%, and so the rate over
    the burst. Meanwhile `invoke top` in an 80-column tmux: a row per replica, its numbers
    moving; then `invoke top --json -` under load as Prometheus says at its instant."""
    env = dict(os.environ, DGEMMA_INVENTORY=str(config.STATE / "inventory"), TERM="xterm-256color")
    tmux("kill-server", check=False)
    subprocess.run(["tmux", "-L", "dgemma-top", "new-session", "-d", "-x", "80", "-y", "30", "-s", "top",
                    f"cd {shlex.quote(str(ROOT))} && {shlex.quote(sys.executable)} -m invoke top --every 2"],
                   env=env, check=True)
    screens = []
    try:
        scraped_since(time.time())
        before = served_so_far()
        with load:
            began = time.monotonic()
            for _ in range(10):
                time.sleep(4)
                screens.append(tmux("capture-pane", "-p", "-t", "top").stdout)
            snapshot = invoke("top", "--json", "-", "--source", "prometheus", check=True)
            took = time.monotonic() - began
        scraped_since(time.time())
        after = served_so_far()
    finally:
        tmux("kill-server", check=False)
    clients, counted = load.answered(), sum(after.values()) - sum(before.values())
    each = {f"{h}/{r}": (before.get((h, r)), after[(h, r)]) for h, r in sorted(after)}
    assert clients > 50 and abs(counted - clients) <= 0.1 * clients, (counted, clients, each)
    assert abs(counted / took - clients / took) <= 0.1 * clients / took
    for screen in screens:
        assert all(len(line) <= 80 for line in screen.splitlines()), screen
    rows = {}
    for screen in screens:
        for line in screen.splitlines():
            fields = line.split()
            if fields and "/" in fields[0] and fields[0].split("/")[0] in SERVING:
                rows.setdefault(fields[0], []).append(" ".join(fields[3:]))
    assert sorted(rows) == sorted(f"{h}/{i}" for h, i in REPLICAS), (sorted(rows), screens[-1])
    still = [r for r, seen in rows.items() if len(set(seen)) < 2]
    assert not still, (still, screens[-1])
    print(f"Prometheus counted {counted:.0f} generations, the clients {clients} answers in {took:.0f} s; "
          f"`invoke top` in tmux (80x30), 10 screens 4 s apart:\n{screens[-1]}")
    (ROOT / "docs" / "captures").mkdir(exist_ok=True)
    (ROOT / "docs" / "captures" / "invoke-top-lab.txt").write_text(screens[-1])
    # --json: the figures are Prometheus's at the instant the snapshot names
    doc = json.loads(snapshot.stdout)
    at = doc["at"]
    running = {(r["metric"]["host"], int(r["metric"]["replica"])): float(r["value"][1])
               for r in prometheus("vllm:num_requests_running", at)}
    kv = {(r["metric"]["host"], int(r["metric"]["replica"])): float(r["value"][1])
          for r in prometheus("vllm:kv_cache_usage_perc", at)}
    tokens = {(r["metric"]["host"], int(r["metric"]["replica"])): float(r["value"][1])
              for r in prometheus("sum by (host, replica) (rate(vllm:generation_tokens_total[1m]))", at)}
    got = {(r["host"], r["replica"]): r for r in doc["replicas"]}
    assert sorted(got) == sorted(REPLICAS)
    for key, row in got.items():
        assert row["running"] == running[key] and row["kv_cache"] == kv[key], (key, row)
        assert row["tokens_s"] == pytest.approx(tokens[key]), (key, row)
        assert row["gpu_util"] is not None, row
        assert row["gpu_memory_total_mib"] or key[0] == "spark01", row  # a GB10's memory is [N/A]
    assert doc["gateway"] == {h: "UP" for h in SERVING}
    assert not load.failed(), load.failed()[:5]


def test_every_dashboard_panel_returns_data(monitored, load):
    """Each query of grafana/dashboards/*.json, its variables a host and replica of the lab, run
    against the lab's Prometheus: every one returns a series."""
    empty = []
    count = 0
    for name in ("fleet", "host", "replica"):
        dashboard = json.loads((ROOT / "grafana" / "dashboards" / f"{name}.json").read_text())
        for panel in dashboard["panels"]:
            for target in panel["targets"]:
                query = (target["expr"].replace("$__rate_interval", "1m").replace("$host", "hgx01")
                         .replace("$replica", "1"))
                count += 1
                if not prometheus(query):
                    empty.append(f"{name}: {panel['title']}: {query}")
    assert count > 40 and not empty, empty


def test_every_diffusion_replica_shows_its_steps_per_token_and_canvas_fill(monitored, load):
    """The replica dashboard's two panels of what the entropy bound does, and the fleet's
    comparison by bound (vLLM's diffusion counters joined with the settings deploy placed), each
    a number for every DiffusionGemma replica the lab's Prometheus scrapes, once traffic went
    through them; and none for Gemma 4 (autoregressive: vLLM exports no diffusion counter)."""
    with load:
        time.sleep(20)
    time.sleep(SCRAPED)
    diffusion = {(r["metric"]["host"], r["metric"]["replica"])
                 for r in prometheus('up{job="vllm", model="diffusiongemma"} == 1')}
    assert len(diffusion) == 5, diffusion  # spark01, rtx01, h100-01 and two of hgx01's four
    panels = {p["title"]: p["targets"][0]["expr"]
              for name in ("fleet", "replica")
              for p in json.loads((ROOT / "grafana" / "dashboards" / f"{name}.json").read_text())["panels"]}
    per_replica = {title: panels[title] for title in ("Denoising steps per committed token", "Canvas fill")}
    for title, expr in per_replica.items():
        for host, replica in sorted(diffusion):
            found = prometheus(expr.replace("$__rate_interval", "1m").replace("$host", host)
                               .replace("$replica", replica))
            values = [float(r["value"][1]) for r in found]
            assert len(values) == 1 and 0 < values[0] < 1, (title, host, replica, found)
    compared = prometheus(panels["Denoising steps per committed token, per replica and entropy bound"]
                          .replace("$__rate_interval", "1m"))
    by_replica = {(r["metric"]["host"], r["metric"]["replica"]): r for r in compared}
    assert set(by_replica) == diffusion, (sorted(by_replica), sorted(diffusion))
    for key, r in by_replica.items():
        assert r["metric"]["diffusion_entropy_bound"] == "0.1" and 0 < float(r["value"][1]) < 1, r
    assert not prometheus('vllm:diffusion_num_committed_tokens_total{model="gemma4"}')
    assert not load.failed(), load.failed()[:5]


def test_metrics_and_the_monitoring_apis_are_closed_without_the_monitoring_key(monitored):
    """From this machine, on the lab network: every host's /metrics/* is as absent (404) with no
    key and with a user's key as any route not allowed; vLLM's own /metrics, the exporters,
    Prometheus and Alertmanager do not listen there at all. With the monitoring key: they answer."""
    import ssl
    import urllib.error
    import urllib.request
    context = ssl.create_default_context(cafile=str(CA_FILE))

    def get(address, path, key=None, scheme="https", port=8000):
        req = urllib.request.Request(f"{scheme}://{address}:{port}{path}",
                                     headers={"Authorization": f"Bearer {key}"} if key else {})
        try:
            with urllib.request.urlopen(req, timeout=10, context=context if scheme == "https" else None) as resp:
                return resp.status
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError as exc:
            return type(exc).__name__

    paths = ["/metrics/sd", "/metrics/haproxy", "/metrics/node", "/metrics/replica/0", "/metrics"]
    for host in ("spark01", "rtx01", "hgx01", "gateway01"):
        for path in paths:
            for key in (None, api_key(), "dgk-not-a-key"):
                assert get(ADDRESS[host], path, key) == 404, (host, path, key is not None)
        for path in paths[:3 if host == "gateway01" else 4]:  # a gateway has no replica of its own
            assert get(ADDRESS[host], path, monitoring_key()) == 200, (host, path)
    for host, port in (("rtx01", 8100), ("rtx01", 9100), ("hgx01", 8103), ("gateway01", 9100), ("gateway01", 8405),
                       (MONITOR, 9090), (MONITOR, 9093), (MONITOR, 9094), (MONITOR, 9100)):
        got = get(ADDRESS[host], "/metrics", scheme="http", port=port)
        assert got in ("ConnectionRefusedError", "URLError"), (host, port, got)


def test_a_killed_replica_and_a_cut_link_alert_with_the_fix_and_resolve(monitored, load):
    """hgx01's replica 1 killed (its next start slow, as a real cold start is) and rtx01's link
    cut, under load: DgemmaReplicaDown reaches the webhook within 60 s naming hgx01, replica 1
    and `invoke recover --hosts hgx01 --replica 1`; DgemmaHostOutOfGateway names rtx01;
    `invoke status` shows the firing alerts and each replica's load. Then the command the alert
    names, and the link back: both resolve. No request fails."""
    inventory, receiver, _ = monitored
    cold = "/srv/models/hf-cache/.vllm-standin/cold-start-seconds"
    rtx = config.host("rtx01")
    ssh("hgx01", f"mkdir -p {os.path.dirname(cold)} && echo 300 > {cold}")
    with load:
        killed = time.time()
        try:
            ssh("hgx01", "podman kill vllm-diffusiongemma-1")
            sh.run("ip", "link", "set", rtx.veth, "down")
            down = alert_receiver.wait_for(receiver, "firing", 90, alertname="DgemmaReplicaDown", host="hgx01",
                                           replica="1")
            within = down["at"] - killed
            out_of_gateway = alert_receiver.wait_for(receiver, "firing", 120, alertname="DgemmaHostOutOfGateway",
                                                     server="rtx01")
            status = invoke("status", "--hosts", "hgx01", "--json", "-", inventory=inventory)
        finally:
            ssh("hgx01", f"rm -f {cold}")
            sh.run("ip", "link", "set", rtx.veth, "up")
            linked = time.time()
            if sys.exc_info()[0] is not None:  # the replica back for the tests that follow, not in 300 s
                invoke("recover", "--hosts", "hgx01", "--replica", "1", inventory=inventory)
        # the command the alert names (its first step drains the replica: ours now, no longer down
        # unawares), which brings it back with the lab's usual cold start
        recovering = time.time()
        fixed = invoke("recover", "--hosts", "hgx01", "--replica", "1", inventory=inventory)
        back = time.time()
        resolved = alert_receiver.wait_for(receiver, "resolved", 120, alertname="DgemmaReplicaDown", host="hgx01",
                                           replica="1")
        rejoined = alert_receiver.wait_for(receiver, "resolved", 120, alertname="DgemmaHostOutOfGateway",
                                           server="rtx01")
    assert down["annotations"]["fix"] == "invoke recover --hosts hgx01 --replica 1", down
    assert within <= 60, f"the alert came {within:.0f} s after the kill"
    assert "rtx01" in out_of_gateway["annotations"]["summary"], out_of_gateway
    assert fixed.returncode == 0, fixed.stdout[-3000:]
    assert resolved["at"] >= recovering, resolved
    doc = json.loads(status.stdout)
    firing = {(a["alertname"], a["host"], a["replica"]) for a in doc["alerts"]}
    assert ("DgemmaReplicaDown", "hgx01", "1") in firing, doc["alerts"]
    loads = {r["replica"]: r["load"] for r in doc["hosts"]["hgx01"]["replicas"]}
    assert loads[1] is None and all(loads[i] and loads[i]["running"] >= 0 for i in (0, 2, 3)), loads
    assert not load.failed(), load.failed()[:5]
    saw = (f"killed hgx01's replica 1: DgemmaReplicaDown at the webhook {within:.0f} s later; rtx01's link cut: "
           f"DgemmaHostOutOfGateway {out_of_gateway['at'] - killed:.0f} s later; resolved "
           f"{resolved['at'] - recovering:.0f} s after `invoke recover --hosts hgx01 --replica 1` began (it took "
           f"{back - recovering:.0f} s), rtx01's out-of-gateway {rejoined['at'] - linked:.0f} s after its "
           f"link came back; 0 failed requests")
    print(saw)
    reliability.record("monitoring-replica-killed", "fault", "a replica's container is killed under load",
                       "podman kill of hgx01's replica 1 (its next cold start 300 s) while 4 clients send chat "
                       "completions through the shared address", within, saw,
                       "DgemmaReplicaDown at the webhook with the command that fixes it; resolved after it ran",
                       True, failed_requests=0)


def test_render_prometheus_gives_the_targets_our_prometheus_found(monitored):
    """`invoke render --format prometheus`: its file_sd targets are the replicas our Prometheus
    discovered from the hosts, and its credentials section names files, no secret."""
    proc = invoke("render", "--format", "prometheus", check=True)
    text = proc.stdout
    part = text.split("# ---- /etc/prometheus/dgemma/targets.json\n", 1)[1].split("\n# ---- ", 1)[0]
    rendered = {(g["labels"]["host"], g["labels"]["__metrics_path__"]) for g in json.loads(part)}
    found = {(t["labels"]["host"], t["discoveredLabels"]["__metrics_path__"]) for t in targets()
             if t["labels"]["job"] in ("vllm", "frontdoor", "gateway", "usage", "node") and t["labels"]["host"] != MONITOR}
    assert rendered == found, (rendered ^ found)
    assert monitoring_key() not in text and "monitoring.key" in text


def test_a_monitoring_host_down_fails_no_deploy_of_the_serving_hosts(monitored):
    """monitor01's link cut: a deploy of it and rtx01 changes nothing on rtx01, reports
    monitor01 unreachable, and exits 0."""
    monitor = config.host(MONITOR)
    sh.run("ip", "link", "set", monitor.veth, "down")
    try:
        proc, report = deploy_json("--hosts", f"rtx01,{MONITOR}", inventory=monitored[0])
    finally:
        sh.run("ip", "link", "set", monitor.veth, "up")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert report["ok"] and report["advisory_failures"] == [MONITOR], report.get("advisory_failures")
    assert report["hosts"][MONITOR]["recap"]["unreachable"] >= 1
    assert report["hosts"]["rtx01"]["recap"]["failed"] == 0
    assert "advisory: the run does not fail for it" in proc.stdout
