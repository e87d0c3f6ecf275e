"""Rolling deploys on the lab (roles/service/rollout.py): a setting that restarts
vLLM changes on every replica of the fleet (7 replicas on 4 hosts) while 4 clients
send requests through the gateways' shared address (gateway01 and gateway02, each
draining the host as the roll goes); Ctrl-C mid-rollout, then the same deploy
again; a streaming request on a replica being drained; a bad release (one that
answers 500, one that exits) fails its gate, goes back to the image it replaced,
and the rollout stops."""
import csv
import io
import json
import re
import shlex
import signal
import subprocess
import sys
import threading
import time

import pytest

from lab import config, images
from tests import reliability
from tests.conftest import ROOT
from tests.lab.conftest import LAB_INVENTORY, deploy_json, front_door, frontdoor_stats, invoke, ssh, ssh_args

GATEWAYS = ("gateway01", "gateway02")
ALL = "spark01,rtx01,h100-01,hgx01," + ",".join(GATEWAYS)
SERVING = ("spark01", "rtx01", "h100-01", "hgx01")
CHAT = {"model": "diffusiongemma", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}


def api_key():
    return config.API_KEY_FILE.read_text().strip()


@pytest.fixture(scope="module")
def fleet(lab):
    proc, _ = deploy_json("--hosts", ALL)
    assert proc.returncode == 0, proc.stdout[-3000:]
    yield lab
    # back to the lab's own settings for the tests after these (a rollout too)
    proc, _ = deploy_json("--hosts", ALL)
    assert proc.returncode == 0, proc.stdout[-3000:]


def running_settings(host) -> dict[int, str]:
    """Loopback port -> --max-num-seqs of each vLLM process that runs on the host now."""
    out = ssh(host, "ps -eo args | grep '[v]llm serve' || true").stdout
    found = {}
    for line in out.splitlines():
        port = re.search(r"--port (\d+)", line)
        seqs = re.search(r"--max-num-seqs (\d+)", line)
        if port and seqs:
            found[int(port.group(1))] = seqs.group(1)
    return found


def main_pids(host) -> dict[str, str]:
    """Each replica unit's main process: every family's (vllm-diffusiongemma, vllm-gemma4)."""
    out = ssh(host, "for u in $(ls /etc/systemd/system | grep -E '^(podman|docker)-vllm-(diffusiongemma|gemma4)"
                    "(-[0-9]+)?[.]service$'); do echo \"$u $(systemctl show -p MainPID --value $u)\"; done").stdout
    return dict(line.split() for line in out.splitlines() if line.strip())


def drained_anywhere() -> dict[str, list[str]]:
    """Host -> replicas its front door has drained (none may be left so)."""
    left = {}
    for host in SERVING:
        rows = frontdoor_stats(host)
        drained = [r["svname"] for r in rows if r["pxname"] == "servers" and r["status"].startswith("DRAIN")]
        if drained:
            left[host] = drained
    return left


def gateway_states(gateway="gateway01") -> dict:
    out = ssh(gateway, "curl -sS --max-time 3 'http://127.0.0.1:8405/stats;csv'", check=False).stdout
    rows = csv.DictReader(io.StringIO(out.lstrip("# ")))
    # the DiffusionGemma pool: every serving host of the lab is in it
    return {r["svname"]: r["status"] for r in rows if r["pxname"] == "pool_diffusiongemma"
            and r["svname"] not in ("FRONTEND", "BACKEND")}


class Load:
    """4 clients sending non-streaming chat completions to the gateways' shared address, and
    a watcher of each gateway's server states, for as long as the block lasts."""

    def __init__(self, clients=4):
        self.clients, self.stop, self.lock = clients, threading.Event(), threading.Lock()
        self.outcomes, self.gateway_seen = [], set()
        self.seen_by = {gateway: set() for gateway in GATEWAYS}  # what each gateway showed

    def _client(self):
        key = api_key()
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                status, body, _ = front_door("gateway01", "/v1/chat/completions", key, CHAT, timeout=90,
                                             address=config.GATEWAY_ADDRESS)
                result = status if status == 200 else f"{status} {body[:160]!r}"
            except OSError as exc:
                result = f"{type(exc).__name__}: {exc}"
            with self.lock:
                self.outcomes.append((started, time.monotonic() - started, result))

    def _watch(self):
        while not self.stop.is_set():
            for gateway in GATEWAYS:
                for server, state in gateway_states(gateway).items():
                    self.gateway_seen.add((server, state.split(" ")[0]))
                    self.seen_by[gateway].add((server, state.split(" ")[0]))
            time.sleep(0.2)

    def __enter__(self):
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        self.threads.append(threading.Thread(target=self._watch, daemon=True))
        for t in self.threads:
            t.start()
        time.sleep(2)
        return self

    def __exit__(self, *exc):
        time.sleep(2)
        self.stop.set()
        for t in self.threads:
            t.join(120)

    @property
    def failed(self):
        return [o for o in self.outcomes if o[2] != 200]


def rolled(data) -> list[dict]:
    return [t for h in data["hosts"].values() for t in h["tasks"]
            if t["task"].startswith("rolling restart")]


def test_a_setting_rolls_through_the_fleet_one_replica_at_a_time_with_no_failed_request(fleet):
    before = {host: running_settings(host) for host in SERVING}
    assert sum(map(len, before.values())) == 7 and {v for s in before.values() for v in s.values()} == {"4"}
    started = time.monotonic()
    with Load() as load:
        proc, data = deploy_json("--hosts", ALL, "--set", "max_num_seqs=5")
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:]
    after = {host: running_settings(host) for host in SERVING}
    assert {host: set(s) for host, s in after.items()} == {host: set(s) for host, s in before.items()}
    assert {v for s in after.values() for v in s.values()} == {"5"}, after
    steps = rolled(data)
    assert len(steps) == 7 and all(t["status"] == "changed" for t in steps), steps
    assert all("gate passed (the front door" in t["message"] for t in steps), [t["message"] for t in steps]
    assert len(load.outcomes) > 50 and not load.failed, (len(load.outcomes), load.failed[:10])
    # a one-replica host drained is taken out of the gateway's balancing (NOLB) while its requests
    # finish; once its replica stops, the front door's checks see it down and so does the gateway
    drained_hosts = sorted({host for host, state in load.gateway_seen if state == "NOLB"})
    assert set(drained_hosts) & {"spark01", "rtx01", "h100-01"}, load.gateway_seen
    # both gateways drain: each reads the front doors' /health on its own
    for gateway, seen in load.seen_by.items():
        assert {host for host, state in seen if state == "NOLB"} & {"spark01", "rtx01", "h100-01"}, (gateway, seen)
    assert not drained_anywhere()
    # one at a time: the rolls' own durations add up to no more than the rollout took
    floor = sum(t["seconds"] for t in steps)
    assert floor <= data["seconds"] + 1, (floor, data["seconds"])
    saw = (f"7 replicas on 4 hosts rolled one at a time in {data['seconds']:.0f} s (their rolls alone: "
           f"{floor:.0f} s); {len(load.outcomes)} requests from 4 clients through the gateways' shared address, 0 "
           f"failed; gateway01 and gateway02 each showed {', '.join(drained_hosts)} NOLB (drained) as they went out")
    print(saw)
    reliability.record("rollout-setting", "rollout", "a setting that restarts vLLM changes on every replica",
                       "invoke deploy --set max_num_seqs=5 over 7 replicas on 4 hosts, 4 clients through the gateway",
                       took, saw, "every replica on the new setting, one at a time", True, failed_requests=0,
                       requests=len(load.outcomes))


def test_ctrl_c_mid_rollout_leaves_no_replica_drained_and_the_same_deploy_carries_on(fleet):
    # the lab's own setting (4) back from the test above's 5: the tests after this one, and the
    # module's last deploy, find every replica as the lab has it (run alone: 5, from the lab's)
    now = {v for host in SERVING for v in running_settings(host).values()}
    target, setting = ("4", ()) if now == {"5"} else ("5", ("--set", "max_num_seqs=5"))
    args = [sys.executable, "-m", "invoke", "deploy", "--hosts", ALL, *setting]
    env = {"DGEMMA_INVENTORY": str(LAB_INVENTORY), "PYTHONUNBUFFERED": "1", "COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    with Load() as load:
        proc = subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        out = []
        for line in proc.stdout:  # the first replica rolled: the next is in flight or waiting
            out.append(line)
            if re.search(r"changed\s+\S+\s+service \| rolling restart", line):
                break
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=300)
        out.append(rest)
        text = "".join(out)
        assert proc.returncode == 130, text[-3000:]
        assert "interrupted" in text and "rolling restart" in text, text[-3000:]
        assert not drained_anywhere()
        settings = [v for host in SERVING for v in running_settings(host).values()]
        assert 1 <= settings.count(target) < 7, settings
        again, data = deploy_json("--hosts", ALL, *setting)
    assert again.returncode == 0, again.stdout[-3000:]
    assert {v for host in SERVING for v in running_settings(host).values()} == {target}
    assert len(rolled(data)) == 7 - settings.count(target)
    assert not load.failed, load.failed[:10]
    assert not drained_anywhere()


def test_a_streaming_request_in_flight_on_a_draining_replica_completes(fleet):
    import ssl
    import urllib.request
    from tests.lab.conftest import CA_FILE
    # about 200 canvases: the stand-in sends one every ~0.1 s, so the stream lasts ~20 s, well past
    # the deploy's facts and the roll's wait for the gateways before it drains
    body = {"model": "diffusiongemma", "max_tokens": 51200, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "hi"}]}
    req = urllib.request.Request(f"https://{config.host('rtx01').address}:8000/v1/chat/completions",
                                 data=json.dumps(body).encode(),
                                 headers={"Authorization": f"Bearer {api_key()}", "Content-Type": "application/json"})
    got = {}

    def stream():
        with urllib.request.urlopen(req, timeout=120, context=ssl.create_default_context(cafile=str(CA_FILE))) as resp:
            got["status"], got["body"] = resp.status, resp.read().decode()
    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(1.5)
    proc, data = deploy_json("--hosts", "rtx01", "--set", "max_num_seqs=7")
    reader.join(120)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert got.get("status") == 200 and got["body"].rstrip().endswith("data: [DONE]"), str(got)[-500:]
    chunks = [json.loads(line[6:]) for line in got["body"].splitlines() if line.startswith("data: {")]
    # the last chunk is vLLM's usage alone (choices: []), as --enable-force-include-usage has it
    tokens = sum(len(c["choices"][0]["delta"].get("content", "").split()) for c in chunks if c["choices"])
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 51200
    assert tokens == 51200
    message = rolled(data)[0]["message"]
    drained = float(re.search(r"drained in ([0-9.]+) s", message).group(1))
    assert drained >= 3, message  # it waited for the stream
    assert running_settings("rtx01") == {8100: "7"}


@pytest.mark.parametrize("fault", ["500", "exits"])
def test_a_bad_release_fails_its_gate_goes_back_to_the_old_image_and_stops_the_rollout(fleet, fault):
    hosts = ("rtx01", "h100-01", "hgx01")  # x86_64: the bad release is built for each arch; one arch is enough
    proc = invoke("lab.image", "--fault", fault, check=True)
    ref = re.search(r"x86_64: (\S+)", proc.stdout).group(1)
    pids = {host: main_pids(host) for host in hosts}
    images_before = {host: ssh(host, "podman ps --format '{{.Names}} {{.ImageID}}'").stdout for host in hosts}
    with Load() as load:
        proc, data = deploy_json("--hosts", ",".join(hosts) + "," + ",".join(GATEWAYS), "--set", f"image={ref}")
    assert proc.returncode == 1, proc.stdout[-3000:]
    steps = rolled(data)
    failed = [t for t in steps if t["status"] == "failed"]
    assert len(failed) == 1 and not [t for t in steps if t["status"] == "changed"], steps
    message = failed[0]["message"]
    assert "failed its gate" in message and "rolled back" in message and "in service again" in message, message
    back = float(re.search(r"again ([0-9.]+) s after the failure", message).group(1))
    assert back < 60, message
    assert ("answered 500" in message) if fault == "500" else ("exited" in message), message
    # every replica runs what it ran: the failed one a new process on the old image, the others untouched
    failed_host = next(h for h, d in data["hosts"].items() if any(t in failed for t in d["tasks"]))
    after = {host: main_pids(host) for host in hosts}
    changed = {(h, u) for h in hosts for u in after[h] if after[h][u] != pids[h].get(u)}
    assert len(changed) == 1 and next(iter(changed))[0] == failed_host, changed
    for host in hosts:
        assert ssh(host, "podman ps --format '{{.Names}} {{.ImageID}}'").stdout.split() and \
            sorted(ssh(host, "podman ps --format '{{.Names}} {{.ImageID}}'").stdout.split()) == \
            sorted(images_before[host].split())
        assert ref not in ssh(host, "cat /etc/systemd/system/podman-vllm-diffusiongemma*.service").stdout
    assert not load.failed, load.failed[:10]
    assert not drained_anywhere()
    skipped = [t for h in data["hosts"].values() for t in h["tasks"] if t["status"] == "skipped"
               and t["task"].startswith("rolling restart")]
    assert all("rollout stopped" in t["message"] for t in skipped), skipped
    saw = (f"bad release ({fault}): {failed[0]['task']} on {failed_host} failed its gate and was back on the old "
           f"image, ready and in service {back:.1f} s after the failure; the rollout stopped ({len(skipped)} "
           f"replicas not started); {len(load.outcomes)} requests through the gateway, 0 failed")
    print(saw)
    reliability.record(f"rollout-bad-release-{fault}", "rollout", f"a bad release ({fault}) rolled out",
                       f"invoke deploy --set image=<{images.fault_tag('x86_64', fault)}> on 3 hosts, 4 clients "
                       "through the gateway", back, saw, "rolled back, the rollout stopped", True,
                       failed_requests=0, requests=len(load.outcomes))


def _json(tmp_path, name):
    return tmp_path / f"{name}.json"


def test_invoke_restart_of_every_serving_host_rolls_one_replica_at_a_time_with_no_failed_request(fleet, tmp_path):
    """Day 2 through the roll: `invoke restart` on every serving host of the lab while 4 clients
    send requests through the gateway. Every replica restarts (a new process), one of the fleet
    at a time, and a one-replica host is held drained in the gateway for its whole roll."""
    before = {host: main_pids(host) for host in SERVING}
    out = _json(tmp_path, "restart")
    started = time.monotonic()
    with Load() as load:
        proc = invoke("restart", "--hosts", ",".join(SERVING), "--json", out)
    took = time.monotonic() - started
    assert proc.returncode == 0, proc.stdout[-4000:]
    data = json.loads(out.read_text())
    steps = rolled(data)
    assert len(steps) == 7 and all("gate passed (the front door, its checks)" in t["message"] for t in steps), steps
    after = {host: main_pids(host) for host in SERVING}
    assert all(after[h][u] != before[h][u] for h in SERVING for u in before[h]), (before, after)
    assert len(load.outcomes) > 50 and not load.failed, (len(load.outcomes), load.failed[:10])
    floor = sum(t["seconds"] for t in steps)
    assert floor <= data["seconds"] + 1, (floor, data["seconds"])  # one at a time
    # the gateway shows what happens: drained (NOLB) for the whole roll, never down
    single = {"spark01", "rtx01", "h100-01"}
    drained_hosts = sorted({host for host, state in load.gateway_seen if state == "NOLB"} & single)
    assert drained_hosts, load.gateway_seen
    assert not {host for host, state in load.gateway_seen if state == "DOWN"}, load.gateway_seen
    assert not drained_anywhere()
    saw = (f"invoke restart of 7 replicas on 4 hosts: one at a time in {data['seconds']:.0f} s (their rolls alone: "
           f"{floor:.0f} s); {len(load.outcomes)} requests from 4 clients through the gateway, 0 failed; the gateway "
           f"showed {', '.join(drained_hosts)} NOLB (drained) and no host DOWN")
    print(saw)
    reliability.record("day2-restart-rolled", "rollout", "invoke restart on every serving host",
                       "invoke restart --hosts spark01,rtx01,h100-01,hgx01 (7 replicas), 4 clients through the "
                       "gateway", took, saw, "every replica restarted, one at a time, drained in the gateway", True,
                       failed_requests=0, requests=len(load.outcomes))


def test_a_roll_waits_for_a_roll_of_its_host_already_under_way(fleet, tmp_path):
    """A roll whose run lost its link runs on, without the run's host lock; the next run's roll
    waits for it on the host (the roll lock, held here for 6 s as such a roll holds it), then
    rolls, and says that it waited."""
    from roles.service.rollout import ROLL_LOCK
    holder = subprocess.Popen([*ssh_args("rtx01"), f"flock {ROLL_LOCK} sh -c 'echo held; sleep 6'"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        out = _json(tmp_path, "restart")
        proc = invoke("restart", "--hosts", "rtx01", "--json", out)
    finally:
        holder.wait(30)
    assert proc.returncode == 0, proc.stdout[-3000:]
    steps = rolled(json.loads(out.read_text()))
    assert len(steps) == 1 and re.search(r"rolled: waited [1-5]\.\d s for another roll of the host to end; drained",
                                         steps[0]["message"]), steps
    assert not drained_anywhere()


def test_invoke_stop_of_a_host_under_load_then_start_through_the_gate(fleet, tmp_path):
    units = sorted(main_pids("hgx01"))
    with Load() as load:
        stop = invoke("stop", "--hosts", "hgx01", "--json", _json(tmp_path, "stop"))
        states = ssh("hgx01", f"systemctl is-active {' '.join(units)}", check=False).stdout.split()
        time.sleep(3)  # the gateway has seen it down: every request goes to the others
        start = invoke("start", "--hosts", "hgx01", "--json", _json(tmp_path, "start"))
    assert stop.returncode == 0, stop.stdout[-3000:]
    assert states == ["inactive"] * 4, states
    stopped = [t for t in json.loads(_json(tmp_path, "stop").read_text())["hosts"]["hgx01"]["tasks"]
               if t["task"].startswith("drain and stop")]
    assert len(stopped) == 4 and all("stopped: drained in" in t["message"] for t in stopped), stopped
    assert start.returncode == 0, start.stdout[-3000:]
    gated = [t for t in json.loads(_json(tmp_path, "start").read_text())["hosts"]["hgx01"]["tasks"]
             if t["task"] == "start and gate"]
    assert len(gated) == 1 and "gate passed (the front door, its checks)" in gated[0]["message"], gated
    assert set(ssh("hgx01", f"systemctl is-active {' '.join(units)}").stdout.split()) == {"active"}
    assert ("hgx01", "NOLB") in load.gateway_seen, load.gateway_seen  # its last replica drained first
    assert len(load.outcomes) > 20 and not load.failed, (len(load.outcomes), load.failed[:10])
    assert not drained_anywhere()
    print(f"invoke stop --hosts hgx01 then invoke start under load: {len(load.outcomes)} requests, 0 failed")


def test_verify_and_status_through_a_pipe_print_every_name_whole(fleet, tmp_path):
    """Off a terminal (`| cat`) each check and host name is whole, a line per check or replica."""
    proc, _ = deploy_json("--hosts", "hgx01,rtx01")  # the lab's own values again (a test above set others)
    assert proc.returncode == 0, proc.stdout[-3000:]
    env = {"DGEMMA_INVENTORY": str(LAB_INVENTORY), "PATH": "/usr/bin:/bin", "COLUMNS": "80"}
    out = _json(tmp_path, "verify")
    python, q = shlex.quote(sys.executable), shlex.quote
    verify = subprocess.run(f"{python} -m invoke verify --hosts hgx01,rtx01 --json {q(str(out))} | cat", shell=True,
                            cwd=ROOT, env=env, text=True, capture_output=True, timeout=600)
    data = json.loads(out.read_text())
    assert data["ok"], verify.stdout[-3000:]
    lines = verify.stdout.splitlines()
    for host, entry in data["hosts"].items():
        for check in entry["checks"]:
            word = {"passed": "pass", "skipped": "skip"}[check["status"]]
            whole = re.compile(rf"^{re.escape(host)} +{re.escape(check['check'])} +{word}\b")
            assert any(whole.match(line) for line in lines), (host, check["check"], lines[:5])
    assert "…" not in verify.stdout
    status = subprocess.run(f"{python} -m invoke status --hosts {q(ALL)} | cat", shell=True, cwd=ROOT, env=env,
                            text=True, capture_output=True, timeout=600)
    assert status.returncode == 0, status.stdout[-3000:]
    labels = [line.split()[0] for line in status.stdout.splitlines() if line.strip()]
    assert {"spark01", "rtx01", "h100-01", "hgx01#0", "hgx01#3"} <= set(labels), status.stdout
    assert "gateway" in labels and "…" not in status.stdout
    assert f"shared_address {config.GATEWAY_ADDRESS} held_by=" in status.stdout, status.stdout[-800:]
    assert "diffusion=canvas:256,steps:48,entropy_bound:0.1 " in status.stdout, status.stdout[-800:]


# last: it leaves rtx01's front door configured for a fleet without a gateway (the module's
# fixture deploys the lab's own inventory again after it)
def test_a_generation_default_set_in_the_inventory_rolls_with_no_failed_request(fleet, lab_copy, tmp_path):
    """generation_defaults: DiffusionGemma's max_new_tokens 300 on rtx01, rolled under load with
    no failed request; the replica's command line and `invoke status` say it; a long answer
    that sets no max_tokens stops at 300 ("length"), where the lab's own default (no cap, not
    the checkpoint's 256) gave it whole."""
    long = {"model": "diffusiongemma", "messages": [{"role": "user", "content": "write a long story"}]}

    def answer():
        status, raw, _ = front_door("rtx01", "/v1/chat/completions", api_key(), long)
        assert status == 200, raw[:300]
        data = json.loads(raw)
        return data["choices"][0]["finish_reason"], data["usage"]["completion_tokens"]
    assert answer() == ("stop", 600)
    (lab_copy / "host_vars").mkdir(exist_ok=True)
    (lab_copy / "host_vars" / "rtx01.yml").write_text("generation_defaults:\n  diffusiongemma:\n"
                                                      "    max_new_tokens: 300\n    temperature: 0.7\n")
    with Load() as load:
        proc, data = deploy_json("--hosts", "rtx01", inventory=lab_copy)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert rolled(data) and not load.failed, load.failed[:5]
    assert answer() == ("length", 300)
    command = ssh("rtx01", "ps -eo args | grep '[v]llm serve'").stdout
    assert '--override-generation-config {"max_new_tokens": 300, "temperature": 0.7}' in command, command
    invoke("status", "--hosts", "rtx01", "--json", _json(tmp_path, "status"), inventory=lab_copy)
    replica = json.loads(_json(tmp_path, "status").read_text())["hosts"]["rtx01"]["replicas"][0]
    assert replica["generation"] == {"max_new_tokens": 300, "temperature": 0.7}


# a stand-in for the front door's admin page that answers as HAProxy's stats page does when it
# refuses an action (a redirect to ;st=DENY), for putting REFUSED back in service alone; every
# other request goes to the real page. It listens where the roll asks, in front of the page.
REFUSING_ADMIN = r'''
import os, socket, sys, threading
real, path, refused = sys.argv[1], sys.argv[2], sys.argv[3].encode()
server = socket.socket(socket.AF_UNIX)
server.bind(path)
os.chmod(path, 0o600)
server.listen(16)

def request(conn):
    data = b""
    while b"\r\n\r\n" not in data:
        got = conn.recv(65536)
        if not got:
            return data
        data += got
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(l.split(b":")[1]) for l in head.split(b"\r\n") if l.lower().startswith(b"content-length:")), 0)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body

def serve(conn):
    with conn:
        data = request(conn)
        if b"action=ready" in data and b"s=" + refused + b"&" in data:
            conn.sendall(b"HTTP/1.1 303 See Other\r\nLocation: /;st=DENY\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            return
        upstream = socket.socket(socket.AF_UNIX)
        upstream.connect(real)
        with upstream:
            upstream.sendall(data.replace(b"HTTP/1.1\r\n", b"HTTP/1.0\r\n", 1))
            while True:
                got = upstream.recv(65536)
                if not got:
                    break
                conn.sendall(got)

while True:
    conn, _ = server.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
'''


def test_a_replica_its_front_door_will_not_put_back_fails_the_roll_naming_it_and_the_mend(fleet, tmp_path):
    """rtx01's front door refuses to put replica 0 back in service as its roll ends: the roll
    fails, names the replica and `invoke recover`, which mends it (and the other hosts answer
    meanwhile)."""
    admin = "/run/dgemma-frontdoor/admin-http.sock"
    ssh("rtx01", f"mv {admin} {admin}.real && cat > /run/refusing-admin.py && "
                 f"{{ setsid python3 /run/refusing-admin.py {admin}.real {admin} replica0 >/dev/null 2>&1 & "
                 f"echo $! > /run/refusing-admin.pid; }} && "
                 f"for i in $(seq 50); do [ -S {admin} ] && break; sleep 0.1; done; [ -S {admin} ]",
        input=REFUSING_ADMIN)
    try:
        with Load() as load:
            proc = invoke("restart", "--hosts", "rtx01", "--json", _json(tmp_path, "refused"))
    finally:
        ssh("rtx01", f"kill $(cat /run/refusing-admin.pid); rm -f {admin} /run/refusing-admin.py /run/refusing-admin.pid; "
                     f"mv {admin}.real {admin}")
    assert proc.returncode == 1, proc.stdout[-3000:]
    failed = [t for t in json.loads(_json(tmp_path, "refused").read_text())["hosts"]["rtx01"]["tasks"]
              if t["status"] == "failed"]
    assert failed and "the front door refused to put replica 0 (replica0) back in service after its restart" \
        in failed[0]["message"] and "invoke recover --hosts rtx01 --replica 0" in failed[0]["message"], failed
    state = ssh("rtx01", f"curl -sS --unix-socket {admin} 'http://x/;csv'").stdout
    assert [r["status"] for r in csv.DictReader(io.StringIO(state.lstrip("# ")))
            if r["pxname"] == "servers" and r["svname"] == "replica0"] == ["DRAIN"]
    assert not load.failed, load.failed[:5]
    mend = invoke("recover", "--hosts", "rtx01", "--replica", "0")
    assert mend.returncode == 0, mend.stdout[-3000:]
    assert drained_anywhere() == {}


# last of the module: rtx01's front door, deployed from an inventory with no gateway, refuses the
# gateways' key until the fleet fixture deploys the lab's own inventory again
def test_without_a_gateway_a_lone_replica_is_still_gated_and_the_report_says_it_was_down(fleet, lab_copy):
    import yaml
    hosts = yaml.safe_load((lab_copy / "hosts.yml").read_text())
    del hosts["all"]["children"]["gateway"]  # an inventory with no gateway: each host its own endpoint
    (lab_copy / "hosts.yml").write_text(yaml.safe_dump(hosts))
    (lab_copy / "group_vars" / "gateway.yml").unlink(missing_ok=True)
    proc, data = deploy_json("--hosts", "rtx01", "--set", "max_num_seqs=3", inventory=lab_copy)
    assert proc.returncode == 0, proc.stdout[-3000:]
    message = rolled(data)[0]["message"]
    assert "gate passed (the front door" in message and "rtx01 served no request while it restarted" in message, message
    assert running_settings("rtx01") == {8100: "3"}
    assert not drained_anywhere()
    proc, data = deploy_json("--hosts", "rtx01", "--check", inventory=lab_copy)  # the lab's own setting again
    assert "1 replica of the fleet" not in json.dumps(data) and "one replica of this host at a time" in json.dumps(data)
