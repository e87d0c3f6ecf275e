"""Each key's limits and usage at the gateway, in real HAProxy (Debian's, as in the lab's image)
with the gateway's own configuration, Lua and usage service: two gateways that share their
counts (peers over TLS), before a stand-in front door that answers as vLLM does (usage in
each answer, in every chunk of a stream). The lab's tests (tests/lab/test_lab_limits.py) do
the same through the shared address, the real front doors and the OpenAI SDK."""
import gzip
import io
import datetime
import json
import os
import re
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from http.client import HTTPException, HTTPSConnection, IncompleteRead
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from credentials import ca as fleet_ca
from credentials.keys import digest
from serving import key_limits as limits
from serving.accounting import Accounting, Peer, lua
from serving.haproxy.config import Server, render_config, render_keys
from serving.haproxy.instance import GATEWAY, LIVE_ANSWERS, live_answers
from serving.haproxy.pools import Pool, upstream
from tests.conftest import ROOT
from tests.haproxy_program import haproxy

SERVICE = ROOT / "serving" / "accounting" / "files" / "usage_service.py"
DIFFUSION = "canvas_length=256 max_denoising_steps=48 diffusion_sampler=entropy_bound diffusion_entropy_bound=0.1"
KEYS = {"burst": limits.Limits(requests_per_minute=60), "calm": limits.Limits(requests_at_once=3),
        "budget": limits.Limits(tokens_per_day=120), "old": limits.Limits(expires=1_000_000_000),
        "g4only": limits.Limits(models=("gemma4",)), "owui": limits.Limits(requests_per_minute=3, front_end=True),
        "plain": limits.Limits(requests_per_minute=3), "spender": limits.Limits(upstream=True),
        "fe_many": limits.Limits(requests_per_minute=3, front_end=True, all_users_requests_per_minute=4),
        "fe_tokens": limits.Limits(tokens_per_day=1000, front_end=True, all_users_tokens_per_day=50),
        "fe_whole": limits.Limits(front_end=True, all_users_tokens_per_day=10**6),
        "fe_held": limits.Limits(front_end=True, all_users_tokens_per_day=2100),
        "quick": limits.Limits(tokens_per_day=120), "fe_quick": limits.Limits(front_end=True, all_users_tokens_per_day=120),
        "reserve": limits.Limits(tokens_per_day=2000), "held": limits.Limits(tokens_per_day=1000),
        "cutter": limits.Limits(tokens_per_day=1000), "paying": limits.Limits(tokens_per_day=1000, upstream=True),
        "thrifty": limits.Limits(requests_per_minute=3, tokens_per_day=100),
        "vast": limits.Limits(tokens_per_day=4_000_000_000),
        "api_key_file": limits.UNLIMITED}


class Quiet(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        pass  # a client gone mid-answer (the gateway's checks, a cut stream)


class Door(BaseHTTPRequestHandler):
    """A front door as the gateway sees it: /health, and completions with vLLM's usage (streamed:
    in every chunk, then a last chunk of its own), naming the replica and its diffusion settings."""
    protocol_version = "HTTP/1.1"
    fleet_headers_seen: list = []  # the X-Dgemma-* headers of each completion that reached it

    def do_GET(self):
        self._send(200, b'{"status": "ok"}', "application/json")

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers.get("content-length") or 0)) or b"{}")
        Door.fleet_headers_seen.append(sorted((k.lower(), v) for k, v in self.headers.items()
                                              if k.lower().startswith("x-dgemma-")))
        time.sleep(float(req.get("hold", 0)))
        prompt = sum(len(str(m.get("content", "")).split()) for m in req.get("messages", [])) + 3
        # ``answer_tokens``: fewer than max_tokens (a vast budget's reservation, answered short)
        completion = int(req.get("answer_tokens") or req.get("max_tokens") or req.get("max_output_tokens") or 5)
        if req.get("stream") and self.path == "/v1/responses":
            return self._responses_stream(req, prompt, completion)
        if not req.get("stream"):
            body = {"choices": [{"message": {"content": "w " * completion}}],
                    "usage": {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                              "completion_tokens": completion, "prompt_tokens_details": None}}
            data = json.dumps(body).encode()
            # an external API compresses its answer when the request allows it (vLLM does not)
            if getattr(self.server, "compresses", False) and "gzip" in (self.headers.get("accept-encoding") or ""):
                return self._send(200, gzip.compress(data), "application/json", encoding="gzip")
            return self._send(200, data, "application/json")
        self.send_response(200)
        self._common("text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        dumps = (lambda o: json.dumps(o, separators=(",", ":"))) if req.get("compact") else json.dumps
        base = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "model": req.get("model", "diffusiongemma")}
        # n choices side by side, each chunk with its own choice's count (vLLM's previous_num_tokens[i]);
        # ``cut_after``: the answer ends there, with no last chunk (a replica gone mid-stream), the
        # connection closed ``linger`` seconds after the last event
        choices, events = int(req.get("n") or 1), 0
        # an external API (OpenAI's) puts usage in a stream only when the request asks for it
        asked = (req.get("stream_options") or {}).get("include_usage")
        quiet = getattr(self.server, "usage_if_asked", False) and not asked
        for i in range(completion):
            for index in range(choices):
                usage = {"prompt_tokens": prompt, "completion_tokens": i + 1, "total_tokens": prompt + i + 1}
                chunk = {**base, 'choices': [{'index': index, 'delta': {'content': 'w '}}],
                         **({} if quiet else {'usage': usage})}
                self._chunk(f"data: {dumps(chunk)}\n\n", int(req.get("split", 0)))
                events += 1
                if events == req.get("cut_after"):
                    return self._cut(req)
            time.sleep(float(req.get("pace", 0)))
        completion *= choices
        usage = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
        self._chunk(("" if quiet else f"data: {dumps({**base, 'choices': [], 'usage': usage})}\n\n") + "data: [DONE]\n\n",
                    int(req.get("split", 0)))
        self.wfile.write(b"0\r\n\r\n")

    def _responses_stream(self, req, prompt, completion):
        """The Responses API's stream as vLLM sends it: its usage in its last event alone
        (response.completed); ``cut_after`` deltas, then the connection closed (no last event)."""
        self.send_response(200)
        self._common("text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        self._chunk('event: response.created\ndata: {"type": "response.created", "response": {"id": "resp_1", '
                    '"status": "in_progress", "usage": null}}\n\n')
        for i in range(completion):
            self._chunk('event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
                        '"delta": "w "}\n\n')
            if i + 1 == req.get("cut_after"):
                return self._cut(req)
        usage = {"input_tokens": prompt, "output_tokens": completion, "total_tokens": prompt + completion}
        self._chunk('event: response.completed\ndata: ' + json.dumps(
            {"type": "response.completed", "response": {"id": "resp_1", "status": "completed", "usage": usage}})
            + "\n\n")
        self.wfile.write(b"0\r\n\r\n")

    def _cut(self, req):
        """The answer ends here, with no last event (a replica gone mid-stream): the connection
        closed ``linger`` seconds after what was sent."""
        self.wfile.flush()
        time.sleep(float(req.get("linger", 0)))
        self.connection.shutdown(socket.SHUT_RDWR)
        self.close_connection = True

    def _common(self, kind):
        self.send_header("x-dgemma-pool", "diffusiongemma")
        self.send_header("x-dgemma-replica", "1")
        self.send_header("x-dgemma-diffusion", DIFFUSION)
        self.send_header("content-type", kind)

    def _chunk(self, text, split: int = 0):
        """One HTTP chunk, or (``split``) pieces of that many bytes, each sent on its own, so that an
        event reaches the gateway in parts."""
        data = text.encode()
        for piece in [data[i:i + split] for i in range(0, len(data), split)] if split else [data]:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            self.wfile.flush()
            if split:
                time.sleep(0.001)

    def _send(self, status, body, kind, encoding: str | None = None):
        self.send_response(status)
        self._common(kind)
        if encoding:
            self.send_header("content-encoding", encoding)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Gateway:
    name: str
    dir: Path
    port: int
    usage_port: int
    proc: subprocess.Popen | None = None
    service: subprocess.Popen | None = None

    def ask(self, command: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.dir / "admin.sock"))
            s.sendall(command.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def table(self, name: str) -> dict[str, int]:
        rows = {}
        for line in self.ask(f"show table {name}").splitlines():
            fields = dict(p.split("=", 1) for p in line.split() if "=" in p)
            if "key" in fields:
                rows[fields["key"]] = int(fields.get("gpc0", 0))
        return rows

    def counters(self, name: str, key: str) -> list[int]:
        """An entry's counters, gpc(0) onwards (`show table` writes them gpc0=N gpc1=M ...)."""
        for line in self.ask(f"show table {name} key {key}").splitlines():
            found = re.findall(r"\bgpc(\d+)=(\d+)", line)
            if found:
                return [int(value) for _, value in sorted(found, key=lambda f: int(f[0]))]
        return []

    def counting(self) -> bool:
        pid = next(line.split(":")[1].strip() for line in self.ask("show info").splitlines() if line.startswith("Pid:"))
        return f"@counts:{pid}" in self.table("tokens_day")

    def records(self) -> list[dict]:
        """The records in the order they were answered, as `invoke logs --requests` gives them (the
        service's readers write each its own as it reads them: the file's order is theirs)."""
        return sorted((r for r in self._journal() if "t" in r), key=lambda r: r["t"])  # an access line alone has no "t"

    def _journal(self) -> list[dict]:
        """Every line the usage service wrote: the records, and access lines alone. A line it is still
        writing (after the last newline) is not one yet: read as it is, it is cut JSON."""
        written = (self.dir / "records.log").read_text().split("\n")[:-1]
        return [json.loads(line) for line in written if line.strip()]

    def settled_count(self) -> int:
        """The records once the last request's has come (the service's readers hand theirs over each
        as it reads them: a record may come a moment after its answer)."""
        count = len(self.records())
        while True:
            time.sleep(0.3)
            now = len(self.records())
            if now == count:
                return count
            count = now

    def access_lines(self) -> list[str]:
        """HAProxy's access lines of what carried no record worth one (a health check, a scrape)."""
        return [r["access"] for r in self._journal() if "t" not in r]

    def metrics(self) -> str:
        import urllib.request
        with urllib.request.urlopen(f"http://127.0.0.1:{self.usage_port}/metrics", timeout=5) as resp:
            return resp.read().decode()


class Fleet:
    """Two gateways before one stand-in front door (and a dead one for the upstream's pool)."""

    def __init__(self, tmp: Path, shared: str = "", records_queue: int = 0, day_from_header: bool = False):
        self.records_queue = records_queue  # the usage service's --records-queue (0: the host's as it is)
        haproxy()  # fails, saying how to get it, when it is not there
        self.tmp = tmp
        self.door = Quiet(("127.0.0.1", 0), Door)
        threading.Thread(target=self.door.serve_forever, daemon=True).start()
        self.upstream = Quiet(("127.0.0.1", 0), Door)  # the external API, for spenders alone
        self.upstream.compresses = True
        self.upstream.usage_if_asked = True
        threading.Thread(target=self.upstream.serve_forever, daemon=True).start()
        self.keys = {name: f"sk-{name}-key" for name in KEYS}
        names = ("gateway01", "gateway02")
        self.peer_ports = peer_ports = {n: _free_port() for n in names}
        # the gateways' files in a short folder: a unix socket's path is at most 97 characters, and
        # pytest's own folders grow with the test's name and its run's number (pytest-of-root/pytest-118/...)
        self.files = Path(tempfile.mkdtemp(prefix="gateways-"))
        self.gateways = {n: Gateway(n, self.files / n, _free_port(), _free_port()) for n in names}
        dead = _free_port()
        for i, (name, gw) in enumerate(self.gateways.items()):
            gw.dir.mkdir()
            issued = fleet_ca.host_certificate(tmp, name, [name, "127.0.0.1", *([shared] if shared else [])], make=True)
            (gw.dir / "tls.pem").write_text(issued.cert_pem + issued.key_pem)
            (gw.dir / "ca.crt").write_text((tmp / "ca" / "ca.crt").read_text())
            peer = fleet_ca.peer_certificate(tmp, name, make=True)
            (gw.dir / "peer.pem").write_text(peer.cert_pem + peer.key_pem)
            (gw.dir / "peers-ca.crt").write_text((tmp / "ca" / "ca.crt").read_text())
            (gw.dir / "keys.map").write_text(limits.keys_map({n: digest(k) for n, k in self.keys.items()}))
            (gw.dir / "limits.map").write_text(limits.limits_map(KEYS))
            (gw.dir / "usage.lua").write_text(lua())
            (gw.dir / LIVE_ANSWERS).write_text(live_answers())
            (gw.dir / "monitoring.sha256").write_text(render_keys({"monitoring": digest("sk-monitoring")}))
            (gw.dir / "targets.json").write_text("[]\n")
            (gw.dir / "upstream-keys.map").write_text("gemma4 sk-upstream\n")
            account = Accounting(str(gw.dir / "usage.sock"), "/metrics/usage", gw.usage_port,
                                 f"127.0.0.1:{peer_ports[name]}",
                                 tuple(Peer(n, f"127.0.0.1:{peer_ports[n]}") for n in names),
                                 shared_address=shared, shared_port=gw.port)
            pools = [Pool("diffusiongemma", ("diffusiongemma",), (Server("rtx01", f"127.0.0.1:{self.door.server_address[1]}"),)),
                     Pool("gemma4", ("gemma4",), (Server("hgx01", f"127.0.0.1:{dead}"),),
                          fallback=upstream({"url": f"http://127.0.0.1:{self.upstream.server_address[1]}/v1"}))]
            # with a shared address: on every address (loopback's 127.0.0.0/8 stands in for the two)
            bind = "0.0.0.0" if shared else "127.0.0.1"
            config = render_config(name, {"api_host": bind, "api_port": gw.port}, [], "g1", proxy=GATEWAY,
                                   files=str(gw.dir), socket=str(gw.dir / "admin.sock"),
                                   admin=str(gw.dir / "admin-http.sock"), backend={"inter": "1s"}, pools=pools,
                                   accounting=account)
            config = config.replace("    user haproxy\n    group haproxy\n", "")  # this test may not run as root
            if day_from_header:  # the day a request counts in, as its X-Test-Day says: a test of the day's turn
                config = config.replace("set-var(txn.day) date,div(86400)", "set-var(txn.day) req.hdr(x-test-day)")
            config = config.replace(f"127.0.0.1:{GATEWAY.metrics_port}", f"127.0.0.1:{_free_port()}")
            (gw.dir / "haproxy.cfg").write_text(config)
            self.start_service(gw)
        self.context = ssl.create_default_context(cafile=str(tmp / "ca" / "ca.crt"))
        for gw in self.gateways.values():
            self.start_haproxy(gw)

    def start_service(self, gw: Gateway):
        gw.service = subprocess.Popen(
            [sys.executable, str(SERVICE), "--socket", str(gw.dir / "usage.sock"), "--runtime-api",
             str(gw.dir / "admin.sock"), "--state", str(gw.dir / "usage"), "--limits", str(gw.dir / "limits.map"),
             "--listen", f"127.0.0.1:{gw.usage_port}", "--interval", "0.05", "--merge-every", "0.2",
             "--records-queue", str(self.records_queue)],
            stdout=open(gw.dir / "records.log", "a"), stderr=open(gw.dir / "usage.err", "a"))
        _until(lambda: (gw.dir / "usage.sock").exists(), "the usage service bound its socket")

    def start_haproxy(self, gw: Gateway):
        gw.proc = subprocess.Popen([haproxy(), "-W", "-db", "-f", str(gw.dir / "haproxy.cfg")],
                                   env={**os.environ, "GATEWAY_KEY": "sk-gateway"},
                                   stdout=open(gw.dir / "haproxy.log", "a"), stderr=subprocess.STDOUT)
        _until(lambda: self.call(gw.name, "GET", "/health")[0] == 200, f"{gw.name} answers")
        _until(gw.counting, f"{gw.name}'s usage service marked its worker: it counts")

    def connect(self, gateway: str = "gateway01", timeout: float = 30, address: str = "127.0.0.1") -> HTTPSConnection:
        return HTTPSConnection(address, self.gateways[gateway].port, context=self.context, timeout=timeout)

    def call(self, gateway: str, method: str, path: str, key: str | None = None, body: dict | str | None = None,
             headers: dict | None = None, timeout: float = 30, kept: HTTPSConnection | None = None,
             address: str = "127.0.0.1"):
        """(status, the body as JSON or text, the headers with lower-case names); ``kept``: a
        connection kept alive from one request to the next (as the OpenAI client's), else a new one."""
        connection = kept or self.connect(gateway, timeout, address)
        try:
            # a body given as text is sent as written (repeated keys, escapes)
            connection.request(method, path, body if body is None or isinstance(body, str) else json.dumps(body),
                               {**({"Authorization": f"Bearer {self.keys[key]}"} if key else {}), **(headers or {})})
            resp = connection.getresponse()
            raw = resp.read()
        except IncompleteRead as exc:  # an answer cut off mid-way: status 0, and what came of it
            return 0, exc.partial.decode(errors="replace"), {}
        except (OSError, HTTPException) as exc:
            return 0, repr(exc), {}
        finally:
            if kept is None:
                connection.close()
        try:
            data = json.loads(raw)
        except ValueError:
            data = raw.decode(errors="replace")
        return resp.status, data, {k.lower(): v for k, v in resp.getheaders()}

    def chat(self, key: str, gateway: str = "gateway01", kept: HTTPSConnection | None = None,
             address: str = "127.0.0.1", **body):
        body.setdefault("messages", [{"role": "user", "content": "hello there"}])
        return self.call(gateway, "POST", "/v1/chat/completions", key, body, headers=body.pop("headers", None),
                         kept=kept, address=address)

    def close(self):
        for gw in self.gateways.values():
            for proc in (gw.proc, gw.service):
                if proc and proc.poll() is None:
                    proc.terminate()
                    proc.wait(10)
        self.door.shutdown()
        self.upstream.shutdown()
        shutil.rmtree(self.files, ignore_errors=True)


def _until(check, what: str, timeout: float = 15):
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except OSError:
            pass
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.05)


def _until_gemma4_goes_upstream(fleet):
    """Until the gateway's checks have found gemma4's pool down (a fleet just started has not yet):
    its requests, with a key that may spend there, go to the external API."""
    _until(lambda: fleet.chat("spender", model="gemma4")[2].get("x-dgemma-pool") == "upstream",
           "gemma4's pool is down: its requests go to the external API")


def _usage_of(data) -> int:
    """What a client counts: the usage of a JSON answer, or the last usage of a stream."""
    if isinstance(data, dict):
        return data["usage"]["prompt_tokens"] + data["usage"]["completion_tokens"]
    events = [json.loads(line[6:]) for line in data.splitlines() if line.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")][-1]
    return usage["prompt_tokens"] + usage["completion_tokens"]


def _clear_of_the_minute_turn(seconds: float = 15):
    """Counts per minute of the clock: a test that needs one minute waits out the turn of one."""
    left = 60 - time.time() % 60
    if left < seconds:
        time.sleep(left + 0.2)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    made = Fleet(tmp_path_factory.mktemp("gateways"))
    yield made
    made.close()


def test_a_burst_gets_exactly_its_requests_a_minute_and_the_rest_openais_429(fleet):
    lock = threading.Lock()
    for attempt in range(2):
        _clear_of_the_minute_turn()
        minute = time.time() // 60
        answers = []

        def one():
            got = fleet.chat("burst")
            with lock:
                answers.append(got)

        threads = [threading.Thread(target=one) for _ in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # a burst the machine was too slow to send within one minute of the clock (a loaded CI
        # machine) counts in two: sent again in the next one, the key's count there is its own
        if time.time() // 60 == minute:
            break
        time.sleep(60.2 - time.time() % 60)  # a minute the last burst has no count in
    statuses = sorted(a[0] for a in answers)
    assert statuses.count(200) == 60 and statuses.count(429) == 140, [a[1] for a in answers if a[0] not in (200, 429)]
    refused = [a for a in answers if a[0] == 429]
    for _, body, headers in refused:
        assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
        assert "60 requests of this minute" in body["error"]["message"]
        assert 0 < int(headers["retry-after"]) <= 60
        assert headers["x-ratelimit-remaining-requests"] == "0" and headers["x-ratelimit-limit-requests"] == "60"
    remaining = sorted(int(a[2]["x-ratelimit-remaining-requests"]) for a in answers if a[0] == 200)
    assert remaining == list(range(60)), "each request that passed took the next place"
    # the other gateway holds the same count: a request there is refused too
    assert fleet.chat("burst", gateway="gateway02")[0] == 429


def test_requests_at_once_never_more_than_the_limit(fleet):
    held = []
    threads = []
    for _ in range(3):  # three long ones, one after the other: each takes a place
        threads.append(threading.Thread(target=lambda: held.append(fleet.chat("calm", hold=2)[0])))
        threads[-1].start()
        time.sleep(0.15)
    status, body, headers = fleet.chat("calm")
    assert status == 429 and body["error"]["code"] == "rate_limit_exceeded", body
    assert "3 requests in flight" in body["error"]["message"] and headers["retry-after"] == "1"
    for t in threads:
        t.join()
    assert held == [200, 200, 200]
    assert fleet.chat("calm")[0] == 200, "the places are given back when the answers end"
    # a burst: never more than three at once get through
    burst = []
    threads = [threading.Thread(target=lambda: burst.append(fleet.chat("calm", hold=1)[0])) for _ in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 1 <= burst.count(200) <= 3 and burst.count(200) + burst.count(429) == 12, burst


def _held_back(ask):
    """``ask()`` again while it is refused for what the key's requests hold (429 rate_limit_exceeded,
    retryable: an answer the usage service has not counted yet holds its reservation and its prompt's
    most for a few ms), as the OpenAI client retries it."""
    for _ in range(100):
        status, data, headers = ask()
        if not (status == 429 and headers.get("x-should-retry") == "true"):
            return status, data, headers
        assert data["error"]["code"] == "rate_limit_exceeded" and data["error"]["type"] == "tokens", data
        time.sleep(0.05)
    raise AssertionError(f"still held after 5 s: {data}")


def test_a_days_tokens_counted_from_vllms_usage_streamed_or_not_then_insufficient_quota(fleet):
    spent, answers, last = 0, 0, 0
    kept = fleet.connect()  # one connection, as the OpenAI client keeps: the next request finds the last counted
    for i in range(20):
        stream = {"stream": True, "stream_options": {"include_usage": True}} if i % 2 else {}
        status, data, headers = _held_back(lambda: fleet.chat("budget", max_tokens=7, kept=kept, **stream))
        if status != 200:
            break
        last = _usage_of(data)
        spent += last
        answers += 1
    assert status == 429 and answers >= 2
    assert data["error"]["code"] == "insufficient_quota" and data["error"]["type"] == "insufficient_quota"
    assert headers["x-should-retry"] == "false" and headers["x-ratelimit-remaining-tokens"] == "0"
    assert spent >= 120 and spent - last < 120, "the answer that crossed the limit was given, the next refused"
    day = int(time.time()) // 86400
    _until(lambda: fleet.gateways["gateway01"].table("tokens_day").get(f"budget:{day}") == spent,
           "the table counts what the clients received")
    _until(lambda: fleet.gateways["gateway02"].table("tokens_day").get(f"budget:{day}") == spent,
           "the other gateway holds the same count")
    assert fleet.chat("budget", gateway="gateway02")[0] == 429


MESSAGES = '"messages": [{"role": "user", "content": "hello there"}]'
# what a request may spend, however its body says it (vLLM reads the last of a repeated key, a key
# written with escapes, pydantic's lax integers): each over the key's 2,000 tokens
OVER = [(f'{{{MESSAGES}, "max_tokens": 32000}}', "max_tokens 32000"),
        (f'{{{MESSAGES}}}', "the model's context, 262144"),
        (f'{{{MESSAGES}, "max_tokens": 1000, "n": 4}}', "max_tokens 1000 x n 4"),
        (f'{{"max_tokens": 10, {MESSAGES}, "max_tokens": 5000}}', "max_tokens 5000"),
        (f'{{{MESSAGES}, "max\\u005ftokens": 5000}}', "max_tokens 5000"),
        (f'{{{MESSAGES}, "max_completion_tokens": "5000", "max_tokens": 10}}', "max_completion_tokens 5000"),
        (f'{{{MESSAGES}, "max_tokens": 5e3}}', "max_tokens 5000"),
        ('{"model": "diffusiongemma", "prompt": ["a", "b", "c"], "max_tokens": 700}', "x 3 prompts")]


def test_a_request_is_let_through_only_if_what_it_may_spend_fits_and_is_settled_by_its_usage(fleet):
    day = int(time.time()) // 86400
    table = lambda: fleet.gateways["gateway01"].table("tokens_day").get(f"reserve:{day}", 0)  # noqa: E731
    for raw, said in OVER:
        path = "/v1/completions" if '"prompt"' in raw else "/v1/chat/completions"
        status, data, headers = fleet.call("gateway01", "POST", path, "reserve", raw)
        assert status == 429 and data["error"]["code"] == "insufficient_quota", (raw, status, data)
        assert said in data["error"]["message"] and "has 2000 of its 2000 tokens" in data["error"]["message"], data
        assert headers["x-should-retry"] == "false"
    status, data, _ = fleet.call("gateway01", "POST", "/v1/chat/completions", "reserve",
                                 f'{{{MESSAGES}, "max_tokens": "lots"}}')
    assert status == 400 and data["error"]["code"] == "unreadable_request" and "max_tokens" in data["error"]["message"]
    assert table() == 0, "nothing refused was charged"
    # in flight: 1,500 held by a request the replica answers in 3 s; beside it, on new connections
    # (HAProxy's threads take them in turn), 600 more do not fit, 400 do
    held = {}
    slow = threading.Thread(target=lambda: held.update(answer=fleet.chat("reserve", max_tokens=1500, hold=3)))
    slow.start()
    time.sleep(0.7)
    beside = [fleet.chat("reserve", max_tokens=600) for _ in range(4)]  # each waits 0.2 s for a give-back first
    assert [b[0] for b in beside] == [429] * 4, beside
    # it fits beside what was spent, not beside what is held: refused for now, told to retry
    assert "has 500 of its 2000 tokens of today (UTC) free now" in beside[0][1]["error"]["message"], beside[0]
    assert beside[0][1]["error"]["code"] == "rate_limit_exceeded" and beside[0][2]["x-should-retry"] == "true"
    assert beside[0][2]["retry-after"] == "1"
    fits = fleet.chat("reserve", max_tokens=400)
    slow.join()
    assert fits[0] == 200 and held["answer"][0] == 200, (fits, held)
    spent = _usage_of(fits[1]) + _usage_of(held["answer"][1])
    _until(lambda: table() == spent, "the table holds both answers' usage")
    # a request past any integer (read as the largest) is refused: it never wraps round below what is left
    status, data, _ = fleet.call("gateway01", "POST", "/v1/chat/completions", "reserve",
                                 f'{{{MESSAGES}, "max_tokens": 1e30}}')
    assert status == 429 and data["error"]["code"] == "insufficient_quota", (status, data)
    # settled: what is left is the limit less what the answers used, not less what they reserved
    left = 2000 - spent
    status, data, headers = fleet.chat("reserve", max_tokens=left + 1)
    assert status == 429 and f"has {left} of its 2000 tokens" in data["error"]["message"], data
    status, data, headers = fleet.chat("reserve", max_tokens=left)
    assert status == 200, data
    spent += _usage_of(data)
    assert 2000 < spent <= 2000 + data["usage"]["prompt_tokens"], "over by this request's prompt at most"
    _until(lambda: table() == spent, "the table holds every answer's usage")
    assert fleet.chat("reserve", max_tokens=1)[0] == 429


def _holding(counters: list[int]) -> int:
    """What an entry of tokens_held holds: reserved less refused less given back, modulo 2^32."""
    given, reserved, refused = counters
    return (reserved - refused - given) % 2 ** 32


def test_a_reservation_of_billions_is_held_whole_and_given_back_as_its_answer_is_counted(fleet):
    """A budget of 4e9 tokens (the schema's most): a request that may spend 3,999,000,000 is held
    whole in one addition, and counted beside the next: 1,000,000 tokens left, a request for
    1,000,001 refused, one for 999,000 answered. Once each answer is counted, the usage service
    gives back what it held: the entry holds nothing."""
    gw = fleet.gateways["gateway01"]
    entry = f"vast:{int(time.time()) // 86400}"
    held = {}
    slow = threading.Thread(target=lambda: held.update(answer=fleet.chat("vast", max_tokens=3_999_000_000,
                                                                         answer_tokens=5, hold=2)))
    slow.start()
    try:
        _until(lambda: gw.counters("tokens_held", entry)[1:2] == [3_999_000_000], "the reservation is held")
        assert _holding(gw.counters("tokens_held", entry)) == 3_999_000_000
        status, data, _ = fleet.chat("vast", max_tokens=1_000_001)
        assert status == 429 and "has 1000000 of its 4000000000 tokens" in data["error"]["message"], data
        status, data, _ = fleet.chat("vast", max_tokens=999_000, answer_tokens=5)
        assert status == 200, data
    finally:
        slow.join()
    assert held["answer"][0] == 200, held
    _until(lambda: _holding(gw.counters("tokens_held", entry)) == 0, "everything held was given back")
    given, reserved, refused = gw.counters("tokens_held", entry)
    assert refused == 1_000_001 and given == reserved - refused, (given, reserved, refused)


def test_the_tokens_are_checked_last_and_a_request_they_refuse_takes_its_place_in_the_minute(fleet):
    """One call into Lua for the budget, after the requests' limits: a request refused for what it may
    spend, or for a body the gateway cannot read, has taken its place in its minute (OpenAI counts the
    requests it refuses); one refused for the minute never reaches the budget (nothing reserved)."""
    _clear_of_the_minute_turn(8)
    status, data, _ = fleet.chat("thrifty", max_tokens=500)
    assert status == 429 and data["error"]["code"] == "insufficient_quota", data
    status, data, _ = fleet.call("gateway01", "POST", "/v1/chat/completions", "thrifty",
                                 f'{{{MESSAGES}, "max_tokens": "lots"}}')
    assert status == 400 and data["error"]["code"] == "unreadable_request", data
    status, data, headers = fleet.chat("thrifty", max_tokens=5)
    assert status == 200 and headers["x-ratelimit-remaining-requests"] == "0", (status, headers)
    status, data, headers = fleet.chat("thrifty", max_tokens=5)
    assert status == 429 and data["error"]["code"] == "rate_limit_exceeded", data
    assert "x-ratelimit-remaining-tokens" in headers and int(headers["x-ratelimit-remaining-tokens"]) > 0, headers


@pytest.mark.parametrize("key, users", [("quick", False), ("fe_quick", True)])
def test_an_answer_not_yet_counted_holds_what_it_may_have_spent_and_the_budget_is_spent_exactly(fleet, key, users):
    """A client that sends its next request the moment an answer ends, on a new connection (another
    of the gateway's threads), before the usage service has counted that answer: the answer still
    holds its reservation and, from its first byte, its prompt's most (its body's length). With the
    usage service stopped for the whole burst (the table says 0 throughout): 12 tokens an answer,
    120 a day (the key's, or a front end's over all its users), none answered past the budget, the
    rest refused for now (retryable). Once the service counts them, the budget is spent exactly:
    10 answers in all, then insufficient_quota."""
    gw, day = fleet.gateways["gateway01"], int(time.time()) // 86400
    subject = f"{key}/*" if users else key
    user = (lambda i: {"X-OpenWebUI-User-Email": f"q{i}@lab.org"}) if users else (lambda i: None)
    os.kill(gw.service.pid, signal.SIGSTOP)
    try:
        answers = [fleet.chat(key, max_tokens=7, headers=user(i)) for i in range(20)]
        assert gw.table("tokens_day").get(f"{subject}:{day}", 0) == 0, "the table had none of them meanwhile"
    finally:
        os.kill(gw.service.pid, signal.SIGCONT)
    statuses = [a[0] for a in answers]
    answered = statuses.count(200)
    assert statuses == [200] * answered + [429] * (20 - answered) and 1 <= answered < 10, statuses
    assert all(a[1]["error"]["code"] == "rate_limit_exceeded" and a[2]["x-should-retry"] == "true"
               for a in answers[answered:]), answers[answered]
    spent = sum(_usage_of(a[1]) for a in answers[:answered])
    for i in range(20, 40):
        status, data, _ = _held_back(lambda: fleet.chat(key, max_tokens=7, headers=user(i)))
        if status != 200:
            break
        spent += _usage_of(data)
        answered += 1
    assert status == 429 and data["error"]["code"] == "insufficient_quota", data
    assert (answered, spent) == (10, 120)
    _until(lambda: gw.table("tokens_day").get(f"{subject}:{day}") == spent, "the usage service counted them")


def test_what_a_days_requests_hold_stays_with_that_day(tmp_path):
    """tokens_held counts SUBJECT:DAY: on one connection, the usage service stopped (nothing is
    counted or given back), two answers of day 1 hold their reservations (7) and their prompts' most
    (the body's length); a request of day 2 finds nothing held; day 1's holds are still day 1's, and
    given back once the service counts the answers."""
    fleet = Fleet(tmp_path, day_from_header=True)
    try:
        gw = fleet.gateways["gateway01"]
        kept = fleet.connect()
        body = len(json.dumps({"max_tokens": 7, "messages": [{"role": "user", "content": "hello there"}]}))
        left = lambda day: int(fleet.chat("quick", kept=kept, max_tokens=7,  # noqa: E731
                                          headers={"X-Test-Day": str(day)})[2]["x-ratelimit-remaining-tokens"])
        os.kill(gw.service.pid, signal.SIGSTOP)
        try:
            assert left(1) == 113  # 120 less its own 7
            assert left(1) == 113 - 7 - body
            assert left(2) == 113, "day 2 holds nothing of day 1's"
            assert _holding(gw.counters("tokens_held", "quick:1")) == 2 * (7 + body)
        finally:
            os.kill(gw.service.pid, signal.SIGCONT)
            kept.close()
        _until(lambda: _holding(gw.counters("tokens_held", "quick:1")) == 0, "day 1's holds given back")
        _until(lambda: _holding(gw.counters("tokens_held", "quick:2")) == 0, "day 2's given back")
    finally:
        fleet.close()


def test_a_request_whose_client_leaves_gives_its_reservation_back(fleet):
    day = int(time.time()) // 86400
    connection = fleet.connect(timeout=0.3)  # leaves before the replica answers
    assert fleet.chat("held", max_tokens=900, hold=1.5, kept=connection)[0] == 0
    connection.close()
    time.sleep(2.5)  # the replica has answered (the gateway waits for it: its tokens are charged) or not
    spent = fleet.gateways["gateway01"].table("tokens_day").get(f"held:{day}", 0)
    assert spent in (0, 900 + 5), spent
    status, data, _ = fleet.chat("held", max_tokens=1000 - spent - 5)
    assert status == 200, ("the reservation of the request whose client left still held", data)


def test_a_responses_stream_cut_before_its_usage_is_charged_what_it_reserved(fleet):
    """vLLM's Responses stream carries its usage in its last event alone: one cut before it says
    nothing of what it cost, and is charged the most it could have: its reservation (its
    max_output_tokens) and, for its prompt, its request's body in bytes."""
    day = int(time.time()) // 86400
    table = lambda: fleet.gateways["gateway01"].table("tokens_day").get(f"cutter:{day}", 0)  # noqa: E731
    ask = {"model": "diffusiongemma", "input": "hello", "max_output_tokens": 10, "stream": True}
    status, body, _ = fleet.call("gateway01", "POST", "/v1/responses", "cutter", ask)
    assert status == 200 and "response.completed" in body, body
    _until(lambda: table() == 3 + 10, "the whole stream charged its usage")
    cut = {**ask, "cut_after": 3, "linger": 0.2}
    status, body, _ = fleet.call("gateway01", "POST", "/v1/responses", "cutter", cut)
    assert body.count("event: response.output_text.delta") == 3 and "response.completed" not in body, body
    sent = len(json.dumps(cut).encode())
    _until(lambda: table() == 3 + 10 + sent + 10, "the cut stream charged what it reserved and its body")
    records = [r for r in fleet.gateways["gateway01"].records() if r.get("key") == "cutter"]
    assert [(r["prompt_tokens"], r["completion_tokens"]) for r in records] == [(3, 10), (sent, 10)], records


def test_an_external_apis_stream_that_says_no_usage_is_charged_what_it_reserved(fleet):
    """An external API (OpenAI's) streams usage only to a request that asks for it: a stream the
    client asked none of says nothing of what it cost (and it costs money), so it is charged its
    reservation; one that asked is charged its usage."""
    _until(lambda: fleet.chat("spender", model="gemma4")[0] == 200, "the gateway's check found the external API up")
    day = int(time.time()) // 86400
    table = lambda: fleet.gateways["gateway01"].table("tokens_day").get(f"paying:{day}", 0)  # noqa: E731
    ask = {"model": "gemma4", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6, "n": 2,
           "stream": True}
    status, body, headers = fleet.call("gateway01", "POST", "/v1/chat/completions", "paying", ask)
    assert status == 200 and headers.get("x-dgemma-pool") == "upstream" and '"usage"' not in body, (status, body)
    sent = len(json.dumps(ask).encode())
    _until(lambda: table() == sent + 12, "the stream with no usage charged what it reserved (6 x 2) and its body")
    status, body, _ = fleet.call("gateway01", "POST", "/v1/chat/completions", "paying",
                                 {**ask, "stream_options": {"include_usage": True}})
    assert status == 200 and '"usage"' in body, body
    _until(lambda: table() == sent + 12 + 4 + 12, "the stream with its usage charged it")


def test_an_expired_key_is_refused_as_a_wrong_one_and_a_model_it_may_not_use_named(fleet):
    status, body, _ = fleet.chat("old")
    assert status == 401 and body["error"]["code"] == "invalid_api_key" and "expired" in body["error"]["message"]
    status, body, _ = fleet.chat("g4only", model="diffusiongemma")
    assert status == 403 and body["error"]["code"] == "model_not_allowed", body
    assert "`diffusiongemma`" in body["error"]["message"] and body["error"]["param"] == "model"
    assert fleet.chat("g4only")[0] == 403, "no model named: the first pool's, which it may not use"
    assert fleet.call("gateway01", "GET", "/v1/models", "g4only")[0] == 200


def test_a_clients_fleet_headers_never_reach_a_front_door(fleet):
    """X-Dgemma-Replica at a front door picks a replica, whatever its model: from a client it
    would reach another model than the key's. Every X-Dgemma-* a client sends is dropped."""
    sent = {"X-Dgemma-Replica": "2", "X-DGEMMA-Pool": "gemma4", "x-dgemma-anything": "1"}
    Door.fleet_headers_seen.clear()
    status, _, headers = fleet.chat("api_key_file", model="diffusiongemma", headers=dict(sent))
    assert status == 200 and headers["x-dgemma-pool"] == "diffusiongemma"
    assert Door.fleet_headers_seen == [[("x-dgemma-pool", "diffusiongemma")]], "only the gateway's own pool header"
    status, body, _ = fleet.chat("g4only", headers=dict(sent))  # no model: checked as the first pool's
    assert status == 403 and body["error"]["code"] == "model_not_allowed", body


def test_only_a_key_that_may_spend_reaches_the_external_upstream(fleet):
    _until_gemma4_goes_upstream(fleet)
    status, body, _ = fleet.chat("plain", model="gemma4")
    assert status == 403 and body["error"]["code"] == "upstream_not_allowed", body


def test_an_external_apis_answer_comes_uncompressed_so_its_usage_is_counted(fleet):
    """An external API compresses its answer when the client allows it (OpenAI's SDK sends
    Accept-Encoding: gzip), and a gzip answer's usage is unreadable to the gateway's filter: the
    gateway asks the external API for an uncompressed answer, and its tokens are counted."""
    gw = fleet.gateways["gateway01"]
    _until_gemma4_goes_upstream(fleet)
    before = gw.settled_count()
    status, data, headers = fleet.chat("spender", model="gemma4", max_tokens=6,
                                       headers={"Accept-Encoding": "gzip, deflate"})
    assert status == 200 and "content-encoding" not in headers and data["usage"]["completion_tokens"] == 6, (headers, data)
    _until(lambda: len(gw.records()) > before, "the upstream answer's record")
    record = gw.records()[-1]
    assert (record["completion_tokens"], record["prompt_tokens"]) == (6, 5), record
    # HAProxy's access line is the record's (the gateway's front end logs only to the usage service)
    assert '"POST /v1/chat/completions HTTP/1.1"' in record["access"] and " 200 " in record["access"], record
    assert any('"GET /health HTTP/1.1"' in line for line in gw.access_lines()), "a health check's access line alone"


def test_a_front_ends_users_count_apart_and_other_keys_user_headers_are_ignored(fleet):
    _clear_of_the_minute_turn(8)
    ann = [fleet.chat("owui", headers={"X-OpenWebUI-User-Email": "Ann@Lab.org"})[0] for _ in range(4)]
    bob = [fleet.chat("owui", headers={"X-OpenWebUI-User-Email": "bob@lab.org"})[0] for _ in range(3)]
    assert ann == [200, 200, 200, 429] and bob == [200, 200, 200]
    _, body, _ = fleet.chat("owui", headers={"X-OpenWebUI-User-Email": "Ann@Lab.org"})
    assert body["error"]["message"].startswith("owui/ann@lab.org has made its 3 requests")
    # the same headers from a key that is no front end change nothing: the key counts as one
    plain = [fleet.chat("plain", headers={"X-OpenWebUI-User-Email": f"u{i}@lab.org"})[0] for i in range(4)]
    assert plain == [200, 200, 200, 429]
    # no user named, in every way a client can leave it out: one user, "unknown", with a user's limits
    nameless = [fleet.chat("owui", headers=h)[0] for h in ({}, {"X-OpenWebUI-User-Email": ""},
                                                            {"X-OpenWebUI-User-Email": "-"},
                                                            {"X-OpenWebUI-User-Id": "%%%"})]
    assert nameless == [200, 200, 200, 429], nameless
    _, body, _ = fleet.chat("owui")
    assert body["error"]["message"].startswith("owui/unknown has made its 3 requests"), body


def test_a_front_end_has_a_cap_of_its_own_over_all_its_users(fleet):
    """Each user within its own 3 a minute, five users together past the front end's 4; and a day's
    tokens over all users (the usage service adds each user's answer to the front end's count)."""
    _clear_of_the_minute_turn(8)
    users = [fleet.chat("fe_many", headers={"X-OpenWebUI-User-Email": f"u{i}@lab.org"}) for i in range(5)]
    assert [u[0] for u in users] == [200, 200, 200, 200, 429]
    error = users[-1][1]["error"]
    assert error["code"] == "rate_limit_exceeded" and error["message"].startswith(
        "The front end fe_many has made its 4 requests of this minute over all its users"), error
    # a nameless user is one more user, under the same cap
    assert fleet.chat("fe_many")[0] == 429
    gw, day = fleet.gateways["gateway01"], int(time.time()) // 86400
    spent = 0
    for i in range(10):
        status, data, _ = fleet.chat("fe_tokens", headers={"X-OpenWebUI-User-Email": f"t{i}@lab.org"}, max_tokens=7)
        if status != 200:
            break
        spent += _usage_of(data)  # 12 each: each user far from its own 1000
        _until(lambda: gw.table("tokens_day").get(f"fe_tokens/*:{day}") == spent, "the front end's count")
    # reserved: 4 answers (48 tokens) leave 2, and the next asks for 7
    assert status == 429 and data["error"]["code"] == "insufficient_quota", data
    assert data["error"]["message"].startswith("The front end fe_tokens has 2 of its 50 tokens of today (UTC) left "
                                               "over all its users, and this request may spend up to 7 tokens"), data
    assert spent == 48, spent
    status, data, _ = fleet.chat("fe_tokens", headers={"X-OpenWebUI-User-Email": "last@lab.org"}, max_tokens=2)
    assert status == 200, data
    spent += _usage_of(data)  # past 50 by this one's prompt (5), no more
    _until(lambda: gw.table("tokens_day").get(f"fe_tokens/*:{day}") == spent, "the front end's count")
    status, data, _ = fleet.chat("fe_tokens", headers={"X-OpenWebUI-User-Email": "later@lab.org"}, max_tokens=1)
    assert status == 429 and data["error"]["message"].startswith(
        "The front end fe_tokens has spent its 50 tokens of today (UTC) over all its users"), data
    assert gw.table("tokens_day")[f"fe_tokens/t0@lab.org:{day}"] == 12
    metrics = gw.metrics()
    assert f'dgemma_key_all_users_tokens_today{{key="fe_tokens"}} {spent}' in metrics
    assert 'dgemma_key_all_users_tokens_per_day_limit{key="fe_tokens"} 50' in metrics
    assert 'user="*"' not in metrics


def test_a_front_ends_cap_over_all_its_users_holds_what_its_requests_in_flight_may_spend(fleet):
    """12 users at once, each asking for up to 400 tokens, under a front end's 2,100 a day: what they
    may spend is held over all of them, across the gateway's threads (each on a connection of its own),
    so 5 are let through and 7 refused before any answer is counted; once answered, what they did not
    spend is given back."""
    gw, day = fleet.gateways["gateway01"], int(time.time()) // 86400
    answers: dict = {}

    def ask(i):
        answers[i] = fleet.chat("fe_held", headers={"X-OpenWebUI-User-Email": f"h{i}@lab.org"}, max_tokens=400,
                                hold=1.5)

    users = [threading.Thread(target=ask, args=(i,)) for i in range(12)]
    for user in users:
        user.start()
    for user in users:
        user.join()
    statuses = sorted(a[0] for a in answers.values())
    assert statuses == [200] * 5 + [429] * 7, statuses
    # each fits beside what was spent, not beside what the others hold: refused for now, told to retry
    refused = [a[1]["error"] for a in answers.values() if a[0] == 429]
    assert all(e["code"] == "rate_limit_exceeded" and " free now over all its users" in e["message"]
               for e in refused), refused
    spent = sum(_usage_of(a[1]) for a in answers.values() if a[0] == 200)
    assert spent == 5 * 405, spent
    _until(lambda: gw.table("tokens_day").get(f"fe_held/*:{day}") == spent, "the front end's count")
    # settled: 75 left (2,100 less 2,025 spent), none still held
    status, data, _ = fleet.chat("fe_held", headers={"X-OpenWebUI-User-Email": "h0@lab.org"}, max_tokens=76)
    assert status == 429 and "has 75 of its 2100 tokens" in data["error"]["message"], data
    status, data, _ = fleet.chat("fe_held", headers={"X-OpenWebUI-User-Email": "h0@lab.org"}, max_tokens=75)
    assert status == 200, data


def test_a_reload_and_a_restart_keep_the_days_tokens(fleet):
    gw = fleet.gateways["gateway02"]
    day = int(time.time()) // 86400
    # the day's budget spent, as the test of insufficient_quota above leaves it: this one may run
    # without it (xdist gives each unit test to either worker, each with gateways of its own)
    for _ in range(40):
        if fleet.chat("budget", max_tokens=7)[0] != 200:
            break
    # the whole count: every answer's usage in gateway01's table (the last answers' a few ms after
    # them), and that reached gateway02 through the peers: the same on both for a second (a count read
    # before then is one that the usage service goes on past)
    counted = lambda name: fleet.gateways[name].table("tokens_day").get(f"budget:{day}")  # noqa: E731
    steady = {"since": time.monotonic(), "counts": None}

    def settled():
        counts = (counted("gateway01"), counted("gateway02"))
        if counts != steady["counts"]:
            steady.update(since=time.monotonic(), counts=counts)
        return counts[0] and counts[0] == counts[1] and time.monotonic() - steady["since"] >= 1
    _until(settled, "gateway02 holds gateway01's count of the day, and it stays")
    before = gw.table("tokens_day")
    assert before.get(f"budget:{day}"), before
    # this gateway's usage service has learned the count (it reads the table every 0.2 s)
    _until(lambda: f'dgemma_key_tokens_today{{key="budget",user=""}} {before[f"budget:{day}"]}' in gw.metrics(),
           "the usage service learned the other gateway's count")
    os.kill(gw.proc.pid, signal.SIGUSR2)  # a reload (keys.add, a deploy)
    # the new process answers at once; a request that would be counted is asked to come back (503,
    # Retry-After: 1) until it holds the counts, never let through
    started = time.monotonic()
    refused = []
    while time.monotonic() - started < 1.5:
        status, _, headers = fleet.chat("budget", gateway="gateway02")
        refused.append((status, headers.get("x-ratelimit-remaining-tokens")))
    assert {s for s, _ in refused} <= {429, 503} and refused[-1][0] == 429, [r for r in refused if r[0] != 429]
    assert gw.table("tokens_day")[f"budget:{day}"] == before[f"budget:{day}"]
    # a restart, with the other gateway down too: the usage service puts the day's counts back
    other = fleet.gateways["gateway01"]
    for proc in (other.proc, gw.proc):
        proc.terminate()
        proc.wait(10)
    fleet.start_haproxy(gw)
    _until(lambda: gw.table("tokens_day").get(f"budget:{day}") == before[f"budget:{day}"],
           "the usage service put the day's tokens back")
    assert fleet.chat("budget", gateway="gateway02")[0] == 429
    fleet.start_haproxy(other)


def test_the_records_and_counts_name_every_request_its_key_model_and_diffusion_settings(fleet):
    # an answer of the external upstream for the key (the upstream tests send more; this one may
    # run without them, on another worker with gateways of its own)
    _until_gemma4_goes_upstream(fleet)
    sent = [fleet.chat("spender", max_tokens=4), fleet.chat("spender", stream=True, max_tokens=6,
                                                                 stream_options={"include_usage": True}),
            fleet.chat("spender", model="nope")]
    assert [s[0] for s in sent] == [200, 200, 404]
    gw = fleet.gateways["gateway01"]
    _until(lambda: len([r for r in gw.records() if r["key"] == "spender" and r["model"] != "gemma4"]) == 3,
           "a record for each request")
    records = [r for r in gw.records() if r["key"] == "spender" and r["model"] != "gemma4"]
    # a stream's record is written when HAProxy closes its transaction, which may come after the next
    # request's: each record is told by what it carries (its model, its tokens), not by its place
    assert sorted(r["status"] for r in records) == [200, 200, 404]
    assert [r["status"] for r in records if r["model"] == "nope"] == [404]
    totals = [_usage_of(s[1]) for s in sent[:2]]
    assert totals[0] != totals[1], "4 and 6 completion tokens tell the whole answer from the stream"
    assert sorted(r["prompt_tokens"] + r["completion_tokens"] for r in records if r["model"] != "nope") \
        == sorted(totals)
    ok = sorted((r for r in records if r["model"] != "nope"),
                key=lambda r: totals.index(r["prompt_tokens"] + r["completion_tokens"]))
    assert [r["prompt_tokens"] + r["completion_tokens"] for r in ok] == totals
    for r in ok:
        assert r["pool"] == "diffusiongemma" and r["host"] == "rtx01" and r["replica"] == "1"
        assert r["diffusion"]["diffusion_entropy_bound"] == "0.1" and r["diffusion"]["canvas_length"] == "256"
        assert "not reported per request" in r["diffusion"]["passes"]
        assert r["ms"] is not None
    assert ok[0]["ttft_ms"] is None and ok[1]["ttft_ms"] is not None, "a stream's first token; a whole answer has none"
    # each when it was answered, not when its kept-alive connection was accepted (HAProxy's %Ts)
    assert all(abs(r["t"] - time.time()) < 30 for r in records) and ok[0]["t"] <= ok[1]["t"]
    assert "sk-spender-key" not in (gw.dir / "records.log").read_text()

    def counted():
        metrics = gw.metrics()
        line = next((m for m in metrics.splitlines()
                     if m.startswith('dgemma_usage_completion_tokens_total{key="spender",user="",model="diffusiongemma"}')),
                    "")
        return line.endswith(" 10")
    _until(counted, "Prometheus's figures count the completions (4 + 6)")
    day_file = gw.dir / "usage" / f"{time.strftime('%Y-%m-%d', time.gmtime())}.json"
    _until(lambda: "nope" in json.loads(day_file.read_text())["usage"].get("spender", {}), "the day's counts are saved")
    saved = json.loads(day_file.read_text())["usage"]["spender"]
    assert saved["diffusiongemma"]["completion_tokens"] == 10 and saved["nope"]["errors"] == 1
    assert saved["gemma4"]["upstream_requests"] >= 1, "the external upstream's answers apart"


STREAM_SHAPES = [  # stream_options as sent, then what vLLM sends that client: usage in each chunk, its own last chunk
    (None, False, False), ({"include_usage": False}, False, False), ({"include_usage": True}, False, True),
    ({"include_usage": True, "continuous_usage_stats": True}, True, True)]


@pytest.mark.parametrize("options, in_every_chunk, last_chunk", STREAM_SHAPES)
@pytest.mark.parametrize("wire", [{}, {"compact": True, "split": 7}], ids=["spaced", "compact-in-pieces"])
def test_a_stream_carries_the_usage_its_client_asked_for_and_is_counted_whole(fleet, options, in_every_chunk,
                                                                                last_chunk, wire):
    """The replicas put usage in every chunk and a usage chunk at the end of every stream, for the
    gateway's count (--enable-force-include-usage). The client gets what vLLM sends it for its own
    stream_options: no usage when it did not ask (so ``chunk.choices[0]`` holds on every chunk), the
    last chunk alone when it asked include_usage; and the count is the whole answer's either way.
    ``wire``: vLLM's compact JSON, each event reaching the gateway in 7-byte pieces."""
    gw = fleet.gateways["gateway01"]
    before = gw.settled_count()
    body = {"stream": True, "max_tokens": 9, **wire, **({"stream_options": options} if options is not None else {})}
    status, data, headers = fleet.chat("spender", **body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert data.endswith("data: [DONE]\n\n") and "\n\n\n" not in data, data[-200:]
    events = [json.loads(line[6:]) for line in data.split("\n\n") if line.startswith("data: {")]
    with_choices = [e for e in events if e["choices"]]
    assert len(with_choices) == 9 and "".join(e["choices"][0]["delta"]["content"] for e in with_choices) == "w " * 9
    assert all(("usage" in e) == in_every_chunk for e in with_choices), with_choices[0]
    assert [e for e in events if not e["choices"]] == ([events[-1]] if last_chunk else [])
    if last_chunk:
        assert events[-1]["usage"]["completion_tokens"] == 9 and events[-1]["object"] == "chat.completion.chunk"
    _until(lambda: len(gw.records()) > before, "the stream's record")
    record = gw.records()[-1]
    assert record["key"] == "spender" and record["completion_tokens"] == 9 and record["prompt_tokens"] == 5, record
    assert record["ttft_ms"] is not None


@pytest.mark.parametrize("wire", [{}, {"compact": True, "split": 7}], ids=["spaced", "compact-in-pieces"])
def test_a_stream_of_several_choices_is_counted_whole_cut_off_or_not(fleet, wire):
    """n > 1: each chunk carries its own choice's count, so the last count before a cut is one
    choice's. A whole stream is counted from its last chunk (every choice); one cut off is charged
    the sum of each choice's count so far, not the last chunk's. (The replica's close comes 0.2 s
    after its last event: events that reach HAProxy 2.6 in the same read as the close are passed
    to the client without the filter, on main as here: neither counted nor reshaped.)"""
    gw = fleet.gateways["gateway01"]
    before = gw.settled_count()
    status, data, _ = fleet.chat("spender", stream=True, max_tokens=5, n=3, **wire)
    assert status == 200 and data.endswith("data: [DONE]\n\n")
    _until(lambda: len(gw.records()) > before, "the stream's record")
    assert gw.records()[-1]["completion_tokens"] == 15, gw.records()[-1]
    # cut after 10 events: choice 0 at 4 tokens, choices 1 and 2 at 3 (the last chunk seen says 4)
    before = gw.settled_count()
    status, data, _ = fleet.chat("spender", stream=True, max_tokens=5, n=3, cut_after=10, linger=0.2, **wire)
    received = [json.loads(line[6:]) for line in data.split("\n\n") if line.startswith("data: {")]
    assert status == 0 and len(received) == 10, data[-300:]  # the client saw the answer end there
    _until(lambda: len(gw.records()) > before, "the cut stream's record")
    record = gw.records()[-1]
    assert record["completion_tokens"] == 4 + 3 + 3 and record["prompt_tokens"] == 5, (record["completion_tokens"], "usage" in received[-1], received[-1]["choices"])


def test_the_openai_sdks_plain_loop_reads_every_stream_and_its_usage_is_the_gateways(fleet):
    """The most common client code there is, ``chunk.choices[0].delta.content`` on every chunk,
    through the gateway; and with include_usage, the SDK's usage is the gateway's record."""
    import openai
    gw = fleet.gateways["gateway01"]
    sdk = openai.OpenAI(base_url=f"https://127.0.0.1:{gw.port}/v1", api_key=fleet.keys["spender"], max_retries=0,
                        http_client=openai.DefaultHttpxClient(verify=fleet.context))
    chat = {"model": "diffusiongemma", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 6}
    text = "".join(chunk.choices[0].delta.content or "" for chunk in sdk.chat.completions.create(**chat, stream=True))
    assert text == "w " * 6
    chunks = list(sdk.chat.completions.create(**chat, stream=True, stream_options={"include_usage": True}))
    assert [c.usage for c in chunks[:-1]] == [None] * 6 and chunks[-1].choices == []
    before = gw.settled_count()
    _until(lambda: gw.records()[-1]["completion_tokens"] == chunks[-1].usage.completion_tokens and
           gw.records()[-1]["prompt_tokens"] == chunks[-1].usage.prompt_tokens, "the record is the SDK's usage")
    assert before >= 2


def test_a_key_with_limits_is_answered_at_the_shared_address_alone(tmp_path):
    """Two gateways on every address, sharing one (127.0.0.2 here): a burst for a key with 60 a
    minute, spread over the shared address and each gateway's own, gets exactly 60 answers, all
    at the shared address; elsewhere a 421 that names the address. A key without limits (the
    operator's) is answered on every address; /health too, for the checks."""
    shared = "127.0.0.2"
    fleet = Fleet(tmp_path, shared=shared)
    try:
        _clear_of_the_minute_turn(20)
        answers, lock = [], threading.Lock()

        def one(i):
            gateway, address = (("gateway01", shared), ("gateway01", "127.0.0.1"), ("gateway02", "127.0.0.1"))[i % 3]
            got = fleet.chat("burst", gateway=gateway, address=address)
            with lock:
                answers.append((address, got[0], got[1]))

        threads = [threading.Thread(target=one, args=(i,)) for i in range(200)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(1 for _, status, _ in answers if status == 200) == 60, sorted((a, s) for a, s, _ in answers)
        assert {a for a, status, _ in answers if status == 200} == {shared}
        misdirected = [body for address, status, body in answers if address != shared]
        assert all(b["error"]["code"] == "misdirected_request" for b in misdirected), misdirected[:3]
        # each gateway names the shared address at its own port (the lab's two share one, 8000)
        urls = {f"https://{shared}:{gw.port}/v1" for gw in fleet.gateways.values()}
        assert all(b["error"]["message"].rsplit(" ", 1)[-1] in urls for b in misdirected), misdirected[:3]
        for gateway in fleet.gateways:
            assert fleet.chat("api_key_file", gateway=gateway)[0] == 200
            assert fleet.call(gateway, "GET", "/health")[0] == 200
            # a front end whose only limit is its cap over all its users is a key with limits too
            assert fleet.chat("fe_whole", gateway=gateway)[0] == 421
        assert fleet.chat("fe_whole", address=shared)[0] == 200
    finally:
        fleet.close()


def stranger(tmp: Path, name: str, dials: str, cert: Path | None) -> tuple[subprocess.Popen, Gateway]:
    """An HAProxy on the gateways' network that declares itself gateway02 and dials gateway01's
    peers listener (``dials``: address:port), with ``cert`` as its client certificate or none."""
    # a short path: a unix socket's is at most 97 characters, and pytest's own folders are long
    folder = Path(tempfile.mkdtemp(prefix=f"{name[:12]}-"))
    crt = f" crt {cert}" if cert else ""
    (folder / "haproxy.cfg").write_text(
        f"global\n    stats socket {folder}/admin.sock mode 600 level admin\n    localpeer gateway02\n"
        "defaults\n    mode http\n    timeout connect 2s\n    timeout client 5s\n    timeout server 5s\n"
        f"peers gateways\n    bind 127.0.0.1:{_free_port()}\n"
        f"    server gateway02\n    server gateway01 {dials} ssl verify none{crt}\n"
        "backend tokens_day\n    stick-table type string len 200 size 200k expire 2d store gpc0 peers gateways\n")
    proc = subprocess.Popen([haproxy(), "-db", "-f", str(folder / "haproxy.cfg")],
                            stdout=open(folder / "haproxy.log", "a"), stderr=subprocess.STDOUT)
    stranger = Gateway(name, folder, 0, 0, proc)
    _until(lambda: proc.poll() is None and (folder / "admin.sock").exists() and stranger.ask("show info")
           or proc.poll() is not None, f"{name} runs")
    assert proc.poll() is None, (folder / "haproxy.log").read_text()
    return proc, stranger


def test_a_stranger_can_neither_read_nor_set_the_gateways_counts(fleet, tmp_path):
    """Only a gateway's peer certificate joins the peers: an HAProxy with no certificate, or with a
    front door's (the fleet CA's, a server's alone), gets no count and sets none. A gateway's own
    peer certificate, shown the same way, does: the test can see what it checks."""
    first = fleet.gateways["gateway01"]
    assert fleet.chat("budget", max_tokens=2)[0] in (200, 429)  # gateway01 holds a count of today
    counts = first.table("tokens_day")
    assert counts, "nothing to steal: the test would pass for nothing"
    door = tmp_path / "door.pem"
    issued = fleet_ca.host_certificate(fleet.tmp, "rtx01", ["rtx01", "127.0.0.1"], make=True)
    door.write_text(issued.cert_pem + issued.key_pem)
    for name, cert in (("no-certificate", None), ("front-door-certificate", door)):
        proc, outsider = stranger(tmp_path, name, f"127.0.0.1:{fleet.peer_ports['gateway01']}", cert)
        try:
            outsider.ask("set table tokens_day key stranger:1 data.gpc0 4000000000")
            time.sleep(3)  # peers push within a second of a change, and the whole table on connecting
            assert outsider.table("tokens_day") == {"stranger:1": 4000000000}, f"{name} read the gateways' counts"
            for key in counts:
                outsider.ask(f"set table tokens_day key {key} data.gpc0 4000000000")
            time.sleep(3)
            now = first.table("tokens_day")
            assert "stranger:1" not in now and 4000000000 not in now.values(), f"{name} set a count: {now}"
        finally:
            proc.terminate()
            proc.wait(10)
    proc, member = stranger(tmp_path, "gateway02-certificate", f"127.0.0.1:{fleet.peer_ports['gateway01']}",
                            fleet.gateways["gateway02"].dir / "peer.pem")
    try:
        member.ask("set table tokens_day key member:1 data.gpc0 7")
        _until(lambda: first.table("tokens_day").get("member:1") == 7, "a peer's count reached gateway01", 10)
    finally:
        proc.terminate()
        proc.wait(10)


STALLED = """
import os, signal, subprocess, sys, tempfile, time
from pathlib import Path
from tests.test_gateway_limits import Fleet
fleet = Fleet(Path(tempfile.mkdtemp(prefix="stall")), records_queue=int(sys.argv[1]))
try:
    gw = fleet.gateways["gateway01"]
    # the usage service held, its readers with it (a slow disk, a busy core)
    service = [gw.service.pid] + [int(p) for p in subprocess.run(["pgrep", "-P", str(gw.service.pid)],
                                                                 capture_output=True, text=True).stdout.split()]
    assert len(service) == 5, service  # the parent and its 4 readers
    for pid in service:
        os.kill(pid, signal.SIGSTOP)
    for _ in range(200):
        fleet.chat("spender", max_tokens=1)
    for pid in service:
        os.kill(pid, signal.SIGCONT)
    time.sleep(1.5)
    dropped = next(line for line in gw.ask("show info").splitlines() if line.startswith("DroppedLogs:"))
    lost = next(line for line in gw.metrics().splitlines() if line.startswith("dgemma_usage_records_lost_total "))
    records = sum(1 for r in gw.records() if r["key"] == "spender")
    print(open("/proc/sys/net/unix/max_dgram_qlen").read().strip(), dropped.split()[1], lost.split()[1], records)
finally:
    fleet.close()
"""


@pytest.mark.skipif(not shutil.which("unshare") or os.geteuid() != 0, reason="a network namespace of its own: root")
def test_records_the_usage_service_could_not_take_are_counted_lost_and_its_queue_holds_a_burst():
    """The usage service held while 200 requests pass, in a network namespace of its own (its
    net.unix.max_dgram_qlen is the kernel's default, 10, as on a new host): without --records-queue
    the socket's queue holds 11 records and HAProxy drops the rest, which the service counts as lost
    (dgemma_usage_records_lost_total, from HAProxy's DroppedLogs); with the role's 4096 none is lost."""
    def stalled(queue: int) -> list[int]:
        proc = subprocess.run(["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "-", sys.executable,
                               "-c", STALLED, str(queue)], cwd=ROOT, capture_output=True, text=True, timeout=180)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return [int(x) for x in proc.stdout.split()]
    depth, dropped, lost, records = stalled(0)
    assert depth == 10 and dropped > 150 and lost == dropped and records == 200 - dropped, (depth, dropped, lost)
    # (past about 290 records of a chat, HAProxy's send buffer is full first: the alert's fix says so)
    depth, dropped, lost, records = stalled(4096)
    assert (depth, dropped, lost, records) == (4096, 0, 0, 200)


def test_the_usage_service_reads_records_it_can_and_skips_the_rest():
    sys.path.insert(0, str(SERVICE.parent))
    try:
        import usage_service
    finally:
        sys.path.remove(str(SERVICE.parent))
    assert usage_service.record_of("127.0.0.1:1 [x] api~ b/s 0/0/0/0/0 200 no record here") is None
    assert usage_service.record_of("line @record {not json") is None
    r = usage_service.record_of('x @record {"t_ms": "1795707444800", "key": "owui", "user": "a@x.org", "model": "-", '
                                '"pool": "gemma4", "fallback": "diffusiongemma", "host": "<NOSRV>", "status": "200", '
                                '"prompt_tokens": "5", "completion_tokens": "-", "diffusion": "-"}')
    assert r["subject"] == "owui/a@x.org" and r["host"] == "" and r["completion_tokens"] == 0 and r["t"] == 1795707444.8
    assert usage_service.family_of(r) == "diffusiongemma", "a fallback's request counts for the family asked"
    forged = usage_service.record_of('x @record {"key": "k", "status": "200", "prompt_tokens": "-4000000", '
                                     '"completion_tokens": "-1"}')
    assert forged["prompt_tokens"] == 0 and forged["completion_tokens"] == 0, "no count given back"
    odd = usage_service.record_of('x @record {"status": "\u00b2", "ms": 12, "rpm_n": "-3", "key": "-"}')
    assert (odd["status"], odd["ms"], odd["rpm_n"], odd["subject"]) == (None, 12, -3, "")
    assert usage_service.record_of('x @record [1, 2]') is None
    # the records' time and day, made once a second and once a day, read as datetime writes them
    for t_ms in (1795707444800, 1795707444999, 1795707445000, 1795737599999, 1795737600001):
        t = t_ms / 1000
        when = datetime.datetime.fromtimestamp(t, datetime.timezone.utc)
        assert usage_service.time_of(t) == when.isoformat(timespec="milliseconds")
        assert usage_service.day_of(t) == when.strftime("%Y-%m-%d")
    sent = []
    api = usage_service.RuntimeApi("/nonexistent")
    api._ask = lambda commands: sent.extend(commands) or ""
    api.set_counts("tokens_day", [("k:1", 2 ** 32 + 5), ("k:2", 7)])
    assert sent == ["set table tokens_day key k:1 data.gpc0 4294967295", "set table tokens_day key k:2 data.gpc0 7"]


def test_what_a_request_held_is_given_back_by_its_own_worker_and_never_past_what_is_held(tmp_path):
    """The record says what its request held, in which day's entry and under which HAProxy worker:
    given back to that worker's table alone (a reload's or a restart's new worker never held it),
    each entry's gpc(0) raised by what it held, never past what the entry holds now (modulo 2^32),
    and a record that held nothing gives nothing back."""
    service = _usage_service()
    record = service.record_of('x @record {"key": "fe", "user": "a@x.org", "status": "200", "prompt_tokens": "5", '
                               '"completion_tokens": "7", "holding": "80", "all_holding": "80", "day": "20426", '
                               '"pid": "4242"}')
    assert record["settle"] == (4242, (("fe/a@x.org:20426", 80), ("fe/*:20426", 80)))
    assert service.record_of('x @record {"key": "k", "status": "429", "holding": "-", "day": "20426", '
                             '"pid": "4242"}')["settle"] is None
    tally = service.Tally()
    tally.add(record)
    tally.add({**record, "settle": (4141, (("fe/a@x.org:20426", 30),))})
    usage = service.Usage(str(tmp_path), 7)
    usage.merge(tally)
    assert usage.take_held(4242) == {"fe/a@x.org:20426": 80, "fe/*:20426": 80}
    assert usage.take_held(4242) == {}, "taken once"
    sent = []
    api = service.RuntimeApi("/nonexistent")
    # given back, reserved, refused: the user's entry holds 100, the front end's 50, a third wrapped round
    api.entries = lambda table, keys: {"fe/a@x.org:20426": [10, 120, 10], "fe/*:20426": [0, 60, 10],
                                       "w:1": [2 ** 32 - 5, 20, 0]}
    api._ask = lambda commands: sent.extend(commands) or ""
    back = api.give_back({"fe/a@x.org:20426": 80, "fe/*:20426": 80, "w:1": 30, "gone:1": 9})
    assert sorted(back) == ["set table tokens_held key fe/*:20426 data.gpc 50",
                            "set table tokens_held key fe/a@x.org:20426 data.gpc 90",
                            "set table tokens_held key w:1 data.gpc 20"], back  # 2^32 - 5 + 25, round
    api.set_counts("tokens_day", [("fe/a@x.org:20426", 12)], then=back)
    assert sent[0].startswith("set table tokens_day ") and sent[1:] == back, "the tokens told first, then given back"


def _usage_service():
    sys.path.insert(0, str(SERVICE.parent))
    try:
        import usage_service
    finally:
        sys.path.remove(str(SERVICE.parent))
    return usage_service


def _process(proc: Path, pid: int, cgroup: str, started: int, command: str = "haproxy"):
    (proc / str(pid)).mkdir(parents=True, exist_ok=True)
    (proc / str(pid) / "cgroup").write_text(cgroup)
    fields = ["S"] + ["0"] * 18 + [str(started)] + ["0"] * 10
    (proc / str(pid) / "stat").write_text(f"{pid} ({command} with) spaces) " + " ".join(fields) + "\n")
    (proc / str(pid) / "cmdline").write_text(command.replace(" ", "\0") + "\0")


def test_a_record_is_taken_from_haproxys_processes_alone(tmp_path):
    """Who may send records: the processes in the control group of the one that opened HAProxy's
    runtime API (SO_PEERCRED; here this test's own listening socket), found in a /proc laid out
    for the test: a worker in that group is taken, a process in another is not, a worker's pid used
    again by a stranger is checked again, and a worker that sent and then ended is still taken."""
    usage_service = _usage_service()
    api_dir = Path(tempfile.mkdtemp(prefix="api", dir="/tmp"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(api_dir / "admin.sock"))
        listener.listen(8)
        proc = tmp_path / "proc"
        _process(proc, os.getpid(), "0::/machine.slice/libpod-gateway.scope\n", 100)  # the master
        _process(proc, 4242, "0::/machine.slice/libpod-gateway.scope\n", 200)  # a worker
        _process(proc, 4343, "0::/user.slice/user-1000.slice/session-3.scope\n", 300, "python3 forge.py")
        senders = usage_service.Senders(str(api_dir / "admin.sock"), proc=str(proc))
        assert senders.allows(4242)
        assert not senders.allows(4343), "a local process outside HAProxy's group"
        assert not senders.allows(99999), "a pid that is not there"
        _process(proc, 4242, "0::/user.slice/user-1000.slice/session-3.scope\n", 400, "python3 forge.py")
        # a checked pid is trusted a second before /proc is read again (the kernel gives a pid to
        # another process only after it has handed out every other one): a second later
        assert senders.allows(4242)
        senders.trusted[4242] = time.monotonic() - 1
        assert not senders.allows(4242), "the worker's pid, used again by another process"
        _process(proc, 4244, "0::/machine.slice/libpod-gateway.scope\n", 500)
        assert senders.allows(4244)
        shutil.rmtree(proc / "4244")
        assert senders.allows(4244), "a worker that sent its records, then ended (a reload)"
    finally:
        listener.close()
        shutil.rmtree(api_dir)


def test_the_usage_service_counts_no_record_from_a_stranger(tmp_path):
    """Real datagrams over a real socket with SO_PASSCRED: from a process in HAProxy's control group
    (this test's, HAProxy's being this test's too) each is counted; with HAProxy's group elsewhere
    (a stranger's records) none is, each refused is counted in dgemma_usage_records_refused_total,
    and the service goes on."""
    usage_service = _usage_service()
    folder = Path(tempfile.mkdtemp(prefix="usage", dir="/tmp"))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(folder / "admin.sock"))
    listener.listen(8)
    records = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    records.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    records.bind(str(folder / "usage.sock"))
    usage = usage_service.Usage(str(tmp_path / "state"), 30)
    senders = usage_service.Senders(str(folder / "admin.sock"))
    out = io.StringIO()
    deliver = usage_service.delivering_to(usage, out)
    threading.Thread(target=usage_service.receive, args=(records, deliver, senders), daemon=True).start()
    line = ('x @record {"t_ms": "%d", "key": "k", "status": "200", "prompt_tokens": "10", '
            '"completion_tokens": "990", "path": "/v1/chat/completions"}' % (time.time() * 1000))
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sender.sendto(line.encode(), str(folder / "usage.sock"))
        _until(lambda: "dgemma_key_tokens_today{key=\"k\",user=\"\"} 1000" in usage.metrics({}), "the record counted")
        senders.RELEARN_S = 3600  # HAProxy's group is now elsewhere: every record here is a stranger's
        senders.group, senders.known, senders.trusted = "0::/elsewhere\n", {}, {}
        for _ in range(3):
            sender.sendto(line.encode(), str(folder / "usage.sock"))
        _until(lambda: "dgemma_usage_records_refused_total 3" in usage.metrics({}), "three records refused")
        assert "dgemma_key_tokens_today{key=\"k\",user=\"\"} 1000" in usage.metrics({}), "nothing charged"
        assert out.getvalue().count('"key":"k"') == 1, "a refused record is not written as one"
    finally:
        sender.close()
        records.close()
        listener.close()
        shutil.rmtree(folder)


def test_the_usage_services_readers_share_the_records_and_one_that_ends_ends_the_service(tmp_path):
    """The service as its unit runs it, with 3 readers: 3,000 records sent as fast as the socket
    takes them are each counted once and written once (the kernel gives each datagram to one
    reader), and the lines it read are counted; a reader killed ends the service with a line that
    says so (systemd starts it again), and the other readers end with it (none left reading
    records that no one counts)."""
    folder = Path(tempfile.mkdtemp(prefix="readers", dir="/tmp"))
    api = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # HAProxy's runtime API, this test's process
    api.bind(str(folder / "admin.sock"))
    api.listen(64)

    def answer():
        while True:
            try:
                conn, _ = api.accept()
            except OSError:
                return
            with conn:
                asked = conn.recv(65536).decode()
                try:
                    conn.sendall(f"Pid: {os.getpid()}\nDroppedLogs: 0\n".encode() if "show info" in asked else b"")
                except OSError:
                    pass
    threading.Thread(target=answer, daemon=True).start()
    port = _free_port()
    out = open(tmp_path / "records.log", "w")
    err = open(tmp_path / "service.log", "w")
    service = subprocess.Popen([sys.executable, str(SERVICE), "--socket", str(folder / "usage.sock"), "--runtime-api",
                                str(folder / "admin.sock"), "--state", str(tmp_path / "state"), "--limits",
                                str(tmp_path / "limits.map"), "--listen", f"127.0.0.1:{port}", "--readers", "3"],
                               stdout=out, stderr=err)
    sender = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        _until(lambda: (folder / "usage.sock").exists(), "the service bound its socket")

        def children() -> list:
            return [int(p) for p in subprocess.run(["pgrep", "-P", str(service.pid)], capture_output=True,
                                                   text=True).stdout.split()]
        # the socket is bound before the readers are forked, one after another: on a busy machine
        # the test can look between two forks
        _until(lambda: len(children()) >= 3, "the service forked its 3 readers")
        readers = children()
        assert len(readers) == 3, readers
        for i in range(3000):
            line = ('x @record {"t_ms": "%d", "key": "k%d", "status": "200", "prompt_tokens": "1", '
                    '"completion_tokens": "2", "path": "/v1/chat/completions"}' % (time.time() * 1000, i % 2))
            while True:
                try:
                    sender.sendto(line.encode(), str(folder / "usage.sock"))
                    break
                except OSError:  # the queue full for a moment: sent again, as no HAProxy would
                    time.sleep(0.001)
        sender.sendto(b"a line of HAProxy's that carries no record", str(folder / "usage.sock"))

        def metrics() -> str:
            import urllib.request
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
                return resp.read().decode()
        _until(lambda: "dgemma_usage_records_read_total 3001" in metrics(), "every line read")
        text = metrics()
        assert 'dgemma_usage_requests_total{key="k0",user="",model="-"} 1500' in text, text
        assert 'dgemma_key_tokens_today{key="k1",user=""} 4500' in text
        out.flush()
        written = [json.loads(line) for line in (tmp_path / "records.log").read_text().splitlines()]
        assert len([r for r in written if "t" in r]) == 3000 \
            and any(r.get("access") == "a line of HAProxy's that carries no record" for r in written)
        # a reader ends: the service ends, the other readers with it
        os.kill(readers[1], signal.SIGKILL)
        assert service.wait(10) == 1
        _until(lambda: not any(os.path.exists(f"/proc/{pid}") and
                               open(f"/proc/{pid}/stat").read().rpartition(")")[2].split()[0] != "Z"
                               for pid in readers), "the other readers ended")
        assert f"the records reader {readers[1]} ended" in (tmp_path / "service.log").read_text()
    finally:
        if service.poll() is None:
            service.kill()
        sender.close()
        api.close()
        shutil.rmtree(folder)
