"""The day-2 readings' host programs (day2/host_programs/*.sh), run for real under sh against
local HTTP servers that stand for what they ask (a gateway's stats page and usage service,
Alertmanager, Prometheus, a replica's /metrics, a front door's stats page), then read by their
readers: each program's one result line carries every page whole, whatever bytes it holds."""
from __future__ import annotations

import base64
import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest

from day2 import readings, top
from serving.host_programs import ProgramResultError

STATS = ("# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,status,"
         "weight,act,bck,chkfail,chkdown,lastchg,downtime,qlimit,pid,iid,sid,throttle,lbtot,tracked,type,rate,"
         "rate_lim,rate_max,check_status\n"
         "pool_diffusiongemma,rtx01,0,0,0,1,,3,0,0,,0,,0,0,0,0,NOLB,1,1,0,0,0,42,0,,1,3,1,,3,,2,0,,1,L7STS\n")
# a page with what no shell may quote: quotes, a backslash, a tab, blank lines, a last line without \n
ODD = 'vllm:num_requests_running{model_name="a\\"b"} 2\n\n\tx "y" \\z\nlast'


class Pages:
    """A local HTTP server: path -> (status, body); every request it got, in ``asked``."""

    def __init__(self, pages: dict):
        self.pages, self.asked = pages, []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                owner.asked.append(self.path)
                status, body = owner.pages.get(urlsplit(self.path).path, (404, "not here"))
                data = (body(self.path) if callable(body) else body).encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def pages():
    made = []

    def make(mapping: dict) -> Pages:
        made.append(Pages(mapping))
        return made[-1]
    yield make
    for p in made:
        p.close()


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(script: str, env: dict | None = None) -> str:
    proc = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("\n@result ") + proc.stdout.startswith("@result ") == 1, proc.stdout  # one result
    return proc.stdout


def test_the_gateway_reading_carries_its_stats_and_usage_pages_whole(pages, monkeypatch):
    gateway = pages({"/stats;csv": (200, STATS), "/metrics": (200, ODD)})
    script = readings.pages_script(readings.GATEWAY_PROGRAM, {"stats": (5, gateway.url("/stats;csv")),
                                                              "usage": (3, gateway.url("/metrics"))})
    found = readings.read_gateway(run(script))
    assert found == {"stats": STATS.rstrip("\n"), "usage": ODD, "error": None}  # (the shell drops a last \n)
    monkeypatch.setattr(readings.GatewayServers, "command", script)
    servers = readings.GatewayServers().process(run(script), 0)
    assert servers["ok"] and [(s["server"], s["state"]) for s in servers["servers"]] == [("rtx01", "DRAIN")]


def test_a_gateway_that_does_not_answer_is_said_so_with_curls_words():
    port = closed_port()
    out = run(readings.pages_script(readings.GATEWAY_PROGRAM, {"stats": (5, f"http://127.0.0.1:{port}/stats;csv"),
                                                               "usage": (3, f"http://127.0.0.1:{port}/metrics")}))
    servers = readings.GatewayServers().process(out, 0)
    assert not servers["ok"] and servers["servers"] == [] and "Failed to connect" in servers["error"], servers
    assert readings.read_gateway(out)["usage"] == ""


def test_firing_alerts_come_from_alertmanagers_answer_and_a_failure_says_why(pages):
    alerts = [{"labels": {"alertname": "DgemmaReplicaDown", "severity": "critical", "host": "rtx01"},
               "annotations": {"summary": "down", "fix": "invoke recover --hosts rtx01"}, "startsAt": "t0"},
              {"labels": {"alertname": "DgemmaKvCacheNearlyFull", "severity": "warning", "host": "hgx01"},
               "annotations": {}, "startsAt": "t1"}]
    manager = pages({"/api/v2/alerts": (200, json.dumps(alerts))})
    fact = readings.FiringAlerts({"alertmanager_port": manager.port})
    read = fact.process(run(fact.command), 0)
    assert read["error"] is None and [a["alertname"] for a in read["alerts"]] == ["DgemmaReplicaDown",
                                                                               "DgemmaKvCacheNearlyFull"]
    assert manager.asked == ["/api/v2/alerts?active=true&silenced=false&inhibited=false"]
    assert read["alerts"][0]["fix"] == "invoke recover --hosts rtx01"
    gone = readings.FiringAlerts({"alertmanager_port": closed_port()})
    assert "Failed to connect" in gone.process(run(gone.command), 0)["error"]
    broken = pages({"/api/v2/alerts": (200, "<html>")})
    odd = readings.FiringAlerts({"alertmanager_port": broken.port})
    assert "not JSON" in odd.process(run(odd.command), 0)["error"]


def test_prometheus_is_asked_every_query_at_one_instant_and_each_answer_comes_back_by_name(pages):
    def answer(path):
        query = parse_qs(urlsplit(path).query)
        return json.dumps({"status": "success", "asked": query["query"][0], "time": query["time"][0]})
    prometheus = pages({"/api/v1/query": (200, answer), "/api/v1/alerts": (200, '{"status": "success"}')})
    sections = top.parse_sections(run(top.prometheus_script(prometheus.port, 1795600000.25)))
    assert set(sections) == set(top.QUERIES) | {"alerts"}
    for name, query in top.QUERIES.items():  # each query whole (its quotes, brackets, blanks) at the one instant
        assert json.loads(sections[name]) == {"status": "success", "asked": query, "time": "1795600000.250"}, name
    assert sections["alerts"] == '{"status": "success"}'
    assert len(prometheus.asked) == len(top.QUERIES) + 1


def replica_host(tmp_path, units: dict, containers: str = "") -> dict:
    """A host's replica units in a folder of ours, systemctl and podman stand-ins on a PATH of
    their own (``units``: unit -> the pid systemctl says runs it, 0: none), the environment to run
    a program with, and the globs that find those units (UNIT_GLOBS)."""
    from serving.replicas import unit_globs
    folder = tmp_path / "units"
    folder.mkdir()
    for unit in units:
        (folder / unit).write_text("[Service]\n")
    (folder / "podman-something-else.service").write_text("")  # a unit of no replica
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cases = "".join(f"  {unit}) echo {pid};;\n" for unit, pid in units.items())
    (bin_dir / "systemctl").write_text(f"#!/bin/sh\ncase $5 in\n{cases}  *) echo 0;;\nesac\n")
    # `ps -aq` the ids, `inspect` each one's name and state (docker's names start with "/")
    (bin_dir / "podman").write_text(f"#!/bin/sh\ncase $1 in\n  ps) printf 'id1\\nid2\\nid3\\n';;\n"
                                    f"  inspect) [ \"$4 $5 $6\" = 'id1 id2 id3' ] && printf '{containers}';;\nesac\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {"env": {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"},
            "globs": " ".join(g.replace("/etc/systemd/system", str(folder)) for g in unit_globs({}))}


def a_replica_process(port: int) -> subprocess.Popen:
    """A process in podman's place, with rtx01's podman command line as captured (its words
    after the first), listening (as its --port says) on ``port``."""
    words = [w for w in (Path(__file__).parent / "fixtures/cmdline/rtx01-podman-run.bin").read_bytes().decode()
             .split("\0") if w]
    words[words.index("--port") + 1] = str(port)
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", *words[1:]])


def test_a_serving_hosts_reading_holds_each_replica_of_its_targets(pages, tmp_path):
    """Each replica unit with a process is asked on the port its command line names; which
    replica a unit is, is read on our side."""
    from serving.replicas import replica
    zero, two = replica({}, 0), replica({}, 2)
    vllm = pages({"/metrics": (200, 'vllm:num_requests_running{model_name="dgemma",engine="0"} 2.0\n')})
    frontdoor = pages({"/stats;csv": (200, STATS)})
    targets = tmp_path / "targets.json"
    targets.write_text('[\n' + ',\n'.join(
        '{"labels": {"job": "vllm", "replica": "%d", "model": "diffusiongemma", "host": "rtx01"}, '
        '"targets": ["10.213.0.12:8000"]}' % i for i in (0, 2)) + '\n]\n')
    gpu = tmp_path / "gpu.prom"
    gpu.write_text('DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 97\n')
    process = a_replica_process(vllm.port)
    try:
        host = replica_host(tmp_path, {zero.unit: process.pid, two.unit: 0})  # replica 2: no process
        script = readings.SERVING_HOST_PROGRAM.script({"UNIT_GLOBS": host["globs"], "FIRST_UNIT": zero.unit,
                                                       "TARGETS": targets, "STATS_URL": frontdoor.url("/stats;csv"),
                                                       "GPU_TEXTFILE": gpu})
        reading = readings.read_host(run(script, host["env"]), 10.0, {})
    finally:
        process.kill()
        process.wait()
    assert sorted(reading.replicas) == [0, 2]
    assert reading.replicas[0][1] and not reading.replicas[2][1]  # replica 2 gave no samples
    (row,) = [r for r in top.loads_from_readings("rtx01", reading, None) if r.replica == 0]
    assert (row.up, row.running, row.model) == (True, 2, "diffusiongemma")
    assert reading.gpu and reading.frontdoor and vllm.asked == ["/metrics"]
    # a host with none of it (no unit, no targets, nothing answering): an empty reading, not an error
    bare = readings.SERVING_HOST_PROGRAM.script({"UNIT_GLOBS": str(tmp_path / "none-*.service"),
                                                 "FIRST_UNIT": zero.unit, "TARGETS": tmp_path / "none.json",
                                                 "STATS_URL": f"http://127.0.0.1:{closed_port()}/",
                                                 "GPU_TEXTFILE": tmp_path / "none.prom"})
    empty = readings.read_host(run(bare, host["env"]), 10.0, {})
    assert (empty.replicas, empty.frontdoor, empty.gpu) == ({}, [], [])


def test_a_result_line_missing_or_not_as_declared_is_refused_by_name():
    with pytest.raises(ProgramResultError, match="a gateway's stats and usage: no result line"):
        readings.GATEWAY_READING.result_of("curl: (7) Failed\n")
    with pytest.raises(ProgramResultError, match=r"has \['rc'\], not the fields"):
        readings.GATEWAY_READING.result_of('@result {"rc": 0}\n')
    with pytest.raises(ProgramResultError, match="not JSON"):
        readings.GATEWAY_READING.result_of('@result {"stats_rc": 0, \n')
    last = '@result {"alerts": {"rc": 1, "body": ""}}\n@result {"alerts": {"rc": 0, "body": "%s"}}\n' % \
        base64.b64encode(b"[]").decode()
    assert readings.FiringAlerts({}).process(last, 0) == {"error": None, "alerts": []}  # the last line counts


def test_the_status_probe_reads_each_replica_from_what_runs(pages, tmp_path):
    """The host says what runs: its containers by name, each replica unit's process (its
    command line, whose --port is asked for /health and the load); which replica each is, is
    read on our side. systemctl and podman are stand-ins; the process, /proc and curl are real."""
    from day2.readings import ServiceProbe
    from serving.replicas import replica
    zero, two = replica({}, 0), replica({}, 2)
    vllm = pages({"/health": (200, ""), "/metrics": (200, 'vllm:num_requests_running{engine="0"} 2.0\n'
                                                            'vllm:num_requests_waiting{engine="0"} 1.0\n'
                                                            'vllm:kv_cache_usage_perc{engine="0"} 0.0125\n'
                                                            # a diffusion model's counters, over two engines
                                                            'vllm:diffusion_num_denoising_steps_total{engine="0"} 21.0\n'
                                                            'vllm:diffusion_num_denoising_steps_total{engine="1"} 21.0\n'
                                                            'vllm:diffusion_num_canvas_positions_total{engine="0"} 5376.0\n'
                                                            'vllm:diffusion_num_canvas_positions_total{engine="1"} 5376.0\n'
                                                            'vllm:diffusion_num_committed_tokens_total{engine="0"} 256.0\n'
                                                            'vllm:diffusion_num_committed_tokens_total{engine="1"} 256.0\n')})
    process = a_replica_process(vllm.port)
    try:
        host = replica_host(tmp_path, {zero.unit: process.pid, two.unit: 0},
                            containers=f"{zero.container} running\\n/{two.container} exited\\nstranger running\\n")
        script = readings.REPLICAS_PROGRAM.script({"RUNTIME": "podman", "UNIT_GLOBS": host["globs"],
                                                   "FIRST_UNIT": zero.unit})
        out = run(script, host["env"])
    finally:
        process.kill()
        process.wait()
    found = ServiceProbe({}).process(out, 0)
    assert sorted(found) == [0, 2], found  # the unit of no replica is left out
    assert found[0]["container"] == "running" and found[0]["health"] == "200"
    assert found[0]["load"] == {"running": 2, "waiting": 1, "kv_cache_usage": 0.0125}
    assert found[0]["diffusion"]["max_denoising_steps"] == 48  # rtx01's command line, as it runs
    assert found[0]["denoising"] == {"denoising_steps": 42, "canvas_positions": 10752, "committed_tokens": 512,
                                     "steps_per_committed_token": 0.08203, "canvas_fill": 0.04762}
    assert found[2] == {"container": "exited", "health": "", "load": None, "diffusion": None, "generation": None,
                        "denoising": None}
    assert vllm.asked == ["/health", "/metrics"]


@pytest.mark.parametrize("ps_says_state", [True, False], ids=["docker 20.10+", "older docker"])
def test_the_status_probe_asks_docker_for_its_containers_states_with_one_ps(tmp_path, ps_says_state):
    """docker's ps says each container's state itself (its .State, since 20.10): one docker start,
    not two (a second of CPU each on an emulated host); an older docker, whose ps has no .State,
    is asked as podman is (ps, then inspect). Either way the same states, by name."""
    from day2.readings import ServiceProbe
    from serving.replicas import replica
    zero, two = replica({}, 0), replica({}, 2)
    host = replica_host(tmp_path, {zero.unit: 0, two.unit: 0})
    calls = tmp_path / "docker-calls"
    ps_format = (f"printf '/{zero.container} running\\n/{two.container} exited\\n'" if ps_says_state else
                 "echo 'template: :1:23: executing \"\" at <.State>: can'\\''t evaluate field State' >&2; exit 1")
    (tmp_path / "bin" / "docker").write_text(
        f"#!/bin/sh\necho \"$*\" >>{calls}\ncase \"$1 $2 $3\" in\n"
        f"  'ps -a --format') {ps_format};;\n  'ps -aq '*) printf 'id1\\nid2\\n';;\n"
        f"  'inspect --format '*) printf '/{zero.container} running\\n/{two.container} exited\\n';;\nesac\n")
    (tmp_path / "bin" / "docker").chmod(0o755)
    script = readings.REPLICAS_PROGRAM.script({"RUNTIME": "docker", "UNIT_GLOBS": host["globs"],
                                               "FIRST_UNIT": zero.unit})
    found = ServiceProbe({}).process(run(script, host["env"]), 0)  # which replica each name is: as podman names them
    assert {i: r["container"] for i, r in found.items()} == {0: "running", 2: "exited"}
    asked = calls.read_text().splitlines()
    assert asked[0] == "ps -a --format /{{.Names}} {{.State}}"
    assert len(asked) == (1 if ps_says_state else 3), asked


def _stub(tmp_path, name: str, body: str) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / name).write_text("#!/bin/sh\n" + body)
    (bin_dir / name).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def _journal(tmp_path, units: list[str], index: int | None):
    from day2 import logs
    folder = tmp_path / "units"
    folder.mkdir(exist_ok=True)
    for unit in units:
        (folder / unit).write_text("[Service]\n")
    env = _stub(tmp_path, "journalctl", 'echo "journalctl $*"\n')
    script = logs.journal_command(20, False, index)({}).replace("/etc/systemd/system", str(folder))
    return subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=30, env=env)


def test_the_journal_of_every_replica_unit_or_the_one_asked_for_or_none_there(tmp_path):
    both = ["podman-vllm-diffusiongemma.service", "podman-vllm-gemma4-1.service"]
    proc = _journal(tmp_path, both, None)
    assert proc.stdout.split() == ["journalctl", "-u", both[0], "-u", both[1], "-n", "20", "--no-pager", "-o",
                                   "with-unit"]
    proc = _journal(tmp_path, both, 1)  # replica 1, under its family's name
    assert proc.stdout.split() == ["journalctl", "-u", both[1], "-n", "20", "--no-pager", "-o", "short-iso"]
    from day2.logs import NO_REPLICA
    proc = _journal(tmp_path, both, 2)
    assert proc.returncode == NO_REPLICA and proc.stderr.split() == both and proc.stdout == ""


def test_a_host_with_no_replica_shows_the_journal_of_the_fleets_units_it_has(tmp_path):
    """A gateway: its HAProxy's and its usage service's journal (what DgemmaUsageRecordsLost's fix,
    invoke logs --hosts GATEWAY, asks for), not an empty one of a replica it does not have."""
    ours = ["dgemma-usage.service", "podman-dgemma-gateway.service"]
    proc = _journal(tmp_path, [*ours, "ssh.service"], None)
    assert proc.stdout.split() == ["journalctl", "-u", ours[1], "-u", ours[0], "-n", "20", "--no-pager", "-o",
                                   "with-unit"]


def test_usage_reads_each_day_file_from_the_first_asked_as_a_line(tmp_path):
    from day2.usage import usage_command
    state = tmp_path / "usage"
    state.mkdir()
    for day in ("2026-11-24", "2026-11-25", "2026-11-26"):
        (state / f"{day}.json").write_text('{\n "day": "%s"\n}\n' % day)
    (state / ".2026-11-26.json.tmp").write_text("{}")
    script = usage_command("2026-11-25").replace(STATE_DIR_Q, f"STATE_DIR={state}")
    assert run_plain(script) == '{ "day": "2026-11-25"}\n{ "day": "2026-11-26"}\n'
    assert run_plain(usage_command("2026-11-25").replace(STATE_DIR_Q, f"STATE_DIR={tmp_path}/none")) == ""


def test_request_records_of_one_key_since_a_time_or_the_last_lines(tmp_path):
    from day2.usage import records_command
    lines = ['{"t":1,"key":"alice","n":1}', "usage: a line that is not a record", '{"t":2,"key":"bob","n":2}',
             '{"time":"x","access":"the access line of a health check alone"}', '{"t":3,"key":"alice","n":3}']
    env = _stub(tmp_path, "journalctl", f'echo "$*" > {tmp_path}/asked\nprintf "%s\\n" ' +
                " ".join(f"'{line}'" for line in lines) + "\n")
    out = subprocess.run(["sh", "-s"], input=records_command("2h", "alice", 50), capture_output=True, text=True,
                         env=env, timeout=30).stdout
    assert out.splitlines() == [lines[0], lines[4]]
    assert "--since -2h" in (tmp_path / "asked").read_text()
    out = subprocess.run(["sh", "-s"], input=records_command(None, None, 2), capture_output=True, text=True,
                         env=env, timeout=30).stdout
    assert out.splitlines() == [lines[2], lines[4]] and "--since" not in (tmp_path / "asked").read_text()


def run_plain(script: str) -> str:
    proc = subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


STATE_DIR_Q = "STATE_DIR=/var/lib/dgemma/usage"
