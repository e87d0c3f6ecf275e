"""The gateways' shared address on the lab (gateway01 and gateway02, roles/shared_address):
one holder at a time, named by `invoke status`; the holder's link cut or its HAProxy
stopped moves the address while 4 clients send requests to it, and the old holder's
return moves nothing; a split is reported; keys reach both gateways."""
import json
import threading
import time

import pytest

from lab import config, sh
from roles.shared_address.keepalived import holds, parse_addresses
from tests import reliability
from tests.lab.conftest import deploy_json, front_door, invoke, ssh

GATEWAYS = ("gateway01", "gateway02")
ALL = "spark01,rtx01,h100-01,hgx01," + ",".join(GATEWAYS)
SHARED = config.GATEWAY_ADDRESS
CHAT = {"model": "diffusiongemma", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
GATEWAY_UNIT = "podman-dgemma-gateway.service"


def api_key():
    return config.API_KEY_FILE.read_text().strip()


def holders(gateways=GATEWAYS, shared=SHARED) -> list[str]:
    """The gateways holding the address now, read in their network namespaces."""
    return [g for g in gateways
            if holds(shared, parse_addresses(sh.run("ip", "-n", config.host(g).netns, "-o", "-4", "addr", "show").stdout))]


def wait_holder(limit=30, expected=None, gateways=GATEWAYS, shared=SHARED) -> str:
    """The one gateway holding the address (``expected``, when given), once there is one."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        held = holders(gateways, shared)
        if len(held) == 1 and expected in (None, held[0]):
            return held[0]
        time.sleep(0.2)
    raise AssertionError(f"no single holder of {shared} ({expected or 'any'}) after {limit} s: "
                         f"{holders(gateways, shared)}")


def wait_answering(gateway, limit=60):
    """Until the gateway's HAProxy answers at its own address, and keepalived's check has
    seen it answer twice (it may hold the address again)."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        try:
            if front_door(gateway, "/health", address=config.host(gateway).address, timeout=2)[0] == 200:
                time.sleep(2.5)
                return
        except OSError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"{gateway}'s HAProxy does not answer after {limit} s")


def status_doc() -> dict:
    return json.loads(invoke("status", "--hosts", ",".join(GATEWAYS), "--json", "-").stdout)


@pytest.fixture(scope="module")
def deployed(lab):
    proc, data = deploy_json("--hosts", ALL)
    assert proc.returncode == 0, proc.stdout[-3000:]
    wait_holder()
    return data


class Clients:
    """4 clients sending non-streaming chat completions to the shared address, each
    retrying a request that failed before any answer (its connection refused or reset, or
    no answer within ``timeout``) twice, 0.5 s then 1 s later, as OpenAI's own Python
    client retries by default; and new requests, one every half second each on its own
    connection (``probes``): when they are answered again, and by whom, after a fault."""

    def __init__(self, clients=4, timeout=10, address=SHARED, key=None):
        """``address``: where they send (the built-in lab's shared address); ``key``: theirs (the lab's)."""
        self.clients, self.timeout, self.address, self.key = clients, timeout, address, key
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.requests = []  # (started, ended, final result, answered by, [(start, end, error) of failed attempts])
        self.probes = []  # (started, ended, result, answered by)

    def _attempt(self, key):
        status, body, headers = front_door("gateway01", "/v1/chat/completions", key, CHAT, timeout=self.timeout,
                                           address=self.address)
        return (status if status == 200 else f"{status} {body[:160]!r}"), headers.get("X-Dgemma-Gateway")

    def _one(self, key):
        started, attempts = time.monotonic(), []
        for delay in (0.5, 1.0, None):
            begun = time.monotonic()
            try:
                result, by = self._attempt(key)
                return started, time.monotonic(), result, by, attempts
            except OSError as exc:
                attempts.append((begun, time.monotonic(), f"{type(exc).__name__}: {exc}"))
                if delay is None:
                    return started, time.monotonic(), attempts[-1][2], None, attempts
                time.sleep(delay)

    def _client(self):
        key = self.key or api_key()
        while not self.stop.is_set():
            outcome = self._one(key)
            with self.lock:
                self.requests.append(outcome)

    def _probe(self, key):
        started = time.monotonic()
        try:
            result, by = self._attempt(key)
        except OSError as exc:
            result, by = f"{type(exc).__name__}: {exc}", None
        with self.lock:
            self.probes.append((started, time.monotonic(), result, by))

    def _prober(self):
        key = self.key or api_key()
        while not self.stop.wait(0.5):
            threading.Thread(target=self._probe, args=(key,), daemon=True).start()

    def __enter__(self):
        self.threads = [threading.Thread(target=self._client, daemon=True) for _ in range(self.clients)]
        self.threads.append(threading.Thread(target=self._prober, daemon=True))
        for t in self.threads:
            t.start()
        time.sleep(3)
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(150)
        time.sleep(self.timeout)  # the last probes end

    @property
    def failed(self):
        return [r for r in self.requests if r[2] != 200]

    def in_flight_at(self, moment):
        """Requests whose first attempt was under way at ``moment``."""
        return [r for r in self.requests if r[0] <= moment <= (r[4][0][1] if r[4] else r[1])]

    def first_answer_by(self, gateway, after):
        """Seconds from ``after`` to the first answer, by ``gateway``, to a new request sent after it."""
        ends = [p[1] for p in self.probes if p[0] >= after and p[3] == gateway and p[2] == 200]
        return min(ends) - after if ends else None


def describe(flight) -> str:
    """How the requests in flight ended: their first attempt's error and their final answer,
    alike ones counted together."""
    from collections import Counter
    ended = Counter((f"{r[4][0][2].split(':')[0]} after {r[4][0][1] - r[4][0][0]:.0f} s, retried: " if r[4] else "")
                    + (f"answered by {r[3]}" if r[2] == 200 else f"failed ({r[2]})") + f", {r[1] - r[0]:.0f} s in all"
                    for r in flight)
    return "; ".join(f"{n} x {how}" for how, n in ended.items()) or "none"


def test_one_gateway_holds_the_address_and_status_and_endpoints_name_it(deployed):
    holder = wait_holder()
    doc = status_doc()
    assert doc["shared_address"] == {"address": SHARED, "holders": [holder], "problem": None}, doc
    status, _, headers = front_door("gateway01", "/health", address=SHARED)
    assert status == 200 and headers["X-Dgemma-Gateway"] == holder
    ends = json.loads(invoke("endpoints", "--json", "-", check=True).stdout)
    assert ends["gateway"] == f"https://{SHARED}:8000/v1"
    verified = invoke("verify", "--hosts", ",".join(GATEWAYS), "--json", "-")
    report = json.loads(verified.stdout)
    assert verified.returncode == 0 and report["ok"], verified.stdout[-3000:]
    passed = {(host, row["check"]) for host, h in report["hosts"].items() for row in h["checks"]
              if row["status"] == "passed"}
    for gateway in GATEWAYS:
        assert (gateway, "shared_address: one_gateway_holds_the_shared_address") in passed, passed


def test_the_holders_link_cut_moves_the_address_and_its_return_moves_nothing(deployed):
    holder = wait_holder()
    other = next(g for g in GATEWAYS if g != holder)
    link = config.host(holder).veth  # its side of the lab network: a cable pulled
    with Clients() as clients:
        time.sleep(3)
        cut = time.monotonic()
        sh.run("ip", "link", "set", link, "down")
        try:
            moved = None
            while time.monotonic() - cut < 20:
                if holders() == [other] or other in holders():
                    moved = time.monotonic() - cut
                    break
                time.sleep(0.1)
            time.sleep(6)  # clients served by the new holder (the cut holder's side: alone, it holds it too)
        finally:
            sh.run("ip", "link", "set", link, "up")
        back = time.monotonic()
        # the old holder is back on the network: it stays a backup (VRRP says so at the next advert, 1 s;
        # a holder that took it back would within 3)
        time.sleep(8)
        held_after = holders()
    answered = clients.first_answer_by(other, cut)
    flight = clients.in_flight_at(cut)
    after_return = [r for r in clients.requests if r[0] >= back]
    assert moved is not None and moved < 5, (moved, holders())
    assert answered is not None and answered < 5, answered
    assert held_after == [other], held_after
    assert after_return and all(r[2] == 200 and r[3] == other and not r[4] for r in after_return), after_return[:5]
    assert not clients.failed, clients.failed[:5]
    saw = (f"{holder}'s link cut under 4 clients: {SHARED} moved to {other} in {moved:.1f} s; a new request sent "
           f"after the cut was first answered by {other} {answered:.1f} s after it; in flight at the cut: "
           f"{len(flight)} ({describe(flight)}); {len(clients.requests)} requests, 0 failed after the client's own "
           f"retry; {holder} back: {len(after_return)} requests in the next 8 s, all answered by {other} at the "
           f"first attempt, the address did not move back")
    print(saw)
    reliability.record("shared-address-link-cut", "fault", "the gateway holding the shared address loses its link",
                       f"{holder}'s veth down for {back - cut:.0f} s while 4 clients send chat completions to {SHARED}",
                       moved, saw, f"{other} holds {SHARED}; {holder} stays a backup when it returns", True,
                       failed_requests=0, requests=len(clients.requests))


def test_the_holders_haproxy_stopped_moves_the_address(deployed):
    holder = wait_holder()
    other = next(g for g in GATEWAYS if g != holder)
    with Clients() as clients:
        stopped = time.monotonic()
        ssh(holder, f"systemctl stop {GATEWAY_UNIT}")
        try:
            moved = None
            while time.monotonic() - stopped < 20:
                if other in holders() and holder not in holders():
                    moved = time.monotonic() - stopped
                    break
                time.sleep(0.1)
            time.sleep(5)
        finally:
            ssh(holder, f"systemctl start {GATEWAY_UNIT}")
        wait_answering(holder)
        time.sleep(3)
    assert moved is not None and moved < 6, (moved, holders())
    assert holders() == [other]  # its HAProxy answers again: it does not take the address back
    # until the address moves, the holder refuses connections: a client whose retries all fall
    # in that window fails (reported); none may fail after it
    late = [r for r in clients.failed if r[1] > stopped + moved + 0.5]
    assert not late, late[:5]
    refused = [r for r in clients.requests if r[4]]
    print(f"{holder}'s HAProxy stopped: {SHARED} moved to {other} in {moved:.1f} s; {len(clients.requests)} "
          f"requests, {len(refused)} refused at first ({len(clients.failed)} of them on every retry, all within the "
          f"{moved:.1f} s before the move); none failed after it")


def test_a_split_is_reported_by_status_and_verify(deployed):
    wait_holder()
    for gateway in GATEWAYS:
        wait_answering(gateway)
    # neither gateway hears the other's VRRP: both take the address. (Dropped at the backup
    # alone, it splits only when the backup has the lower priority: a holder hearing a higher
    # priority's adverts gives the address up, whoever held it first.)
    drop = ["-p", "vrrp", "-j", "DROP"]
    for gateway in GATEWAYS:
        sh.run("ip", "netns", "exec", config.host(gateway).netns, "iptables", "-I", "INPUT", *drop)
    try:
        end = time.monotonic() + 20
        while sorted(holders()) != sorted(GATEWAYS) and time.monotonic() < end:
            time.sleep(0.2)
        assert sorted(holders()) == sorted(GATEWAYS), holders()
        proc = invoke("status", "--hosts", ",".join(GATEWAYS), "--json", "-")
        doc = json.loads(proc.stdout)
        assert proc.returncode != 0 and not doc["ok"]
        assert doc["shared_address"]["problem"].startswith(f"split: {' and '.join(GATEWAYS)} each hold {SHARED}")
        verified = invoke("verify", "--hosts", ",".join(GATEWAYS))
        assert verified.returncode != 0 and "split:" in verified.stdout, verified.stdout[-2000:]
    finally:
        for gateway in GATEWAYS:
            sh.run("ip", "netns", "exec", config.host(gateway).netns, "iptables", "-D", "INPUT", *drop)
    # they hear each other again: the higher priority (the first in inventory order) keeps it
    assert wait_holder(15) == GATEWAYS[0]


def test_keys_reach_both_gateways(deployed):
    invoke("keys.revoke", "two-doors", check=False)  # a leftover of an interrupted run
    added = invoke("keys.add", "two-doors", check=True)
    key = added.stdout.rstrip("\n").splitlines()[-1]
    try:
        for gateway in GATEWAYS:
            status, _, headers = front_door(gateway, "/v1/models", key, address=config.host(gateway).address)
            assert status == 200 and headers["X-Dgemma-Gateway"] == gateway
    finally:
        invoke("keys.revoke", "two-doors", check=True)
    for address in [config.host(g).address for g in GATEWAYS] + [SHARED]:
        assert front_door("gateway01", "/v1/models", key, address=address)[0] == 401, address
