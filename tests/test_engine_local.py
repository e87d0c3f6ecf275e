"""The engine on this machine through a local connection: one-script facts,
atomic writes with the previous version kept, secret-safe diffs, host lock."""
import os
import signal as signal_module
import subprocess
import time

from converge.changes import File, mask_secret
from converge.transport.local import LocalTransport as LocalConnection
from converge.errors import RemoteCommandError
from converge.facts import Gathering, gather, split, script
from converge.facts.host import Arch, FileState, MemInfo
from converge.hostlock import KEEP_HOLDING, lock_script


def test_facts_gather_in_one_script_even_when_a_fact_exits():
    class Exits(Arch):
        command = "echo partial; exit 7"

    conn = LocalConnection()
    facts = gather(conn, {"arch": Arch(), "bad": Exits(), "mem": MemInfo()})
    assert facts["arch"] == os.uname().machine
    assert facts["mem"]["MemTotal"] > 0
    raw = split(conn.run(script({"bad": Exits()}, "@@b")).stdout, "@@b")
    assert raw == {"bad": ("partial", 7)}


def test_two_facts_with_one_command_run_it_once_and_both_get_its_answer(tmp_path):
    class Counts(Arch):
        command = f"echo run >> {tmp_path}/runs; wc -l < {tmp_path}/runs"

    class Lines(MemInfo):
        command = Counts.command  # another fact, the same command: it reads the same answer its own way

        def process(self, output, rc):
            return ("lines", output.strip(), rc)

    gathering = Gathering({"counted": Counts(), "arch": Arch(), "lines": Lines()})
    assert gathering.script.count("echo run >>") == 1
    facts = gathering.parse(LocalConnection().run(gathering.script).stdout)
    assert facts.values == {"counted": "1", "arch": os.uname().machine, "lines": ("lines", "1", 0)}
    assert (tmp_path / "runs").read_text() == "run\n"


class _Meets(Arch):
    """Says `together` when the other fact of its pair ran at the same time: each leaves a
    file and waits (up to 10 s, a bound against a hang, not a speed goal) for the other's."""

    def __init__(self, folder, mine, theirs):
        self.command = (f"touch {folder}/{mine}; for i in $(seq 100); do [ -e {folder}/{theirs} ] && break; "
                        f"sleep 0.1; done; [ -e {folder}/{theirs} ] && echo together || echo alone")


def test_file_states_asked_together_answer_as_each_asked_alone(tmp_path, monkeypatch):
    """Files of one gathering are read by one stat and one cat (secrets: one sha256sum): each
    file's state is what it is asked alone, whatever the file is (empty, binary, a link, gone, a
    folder), and a secret's bytes are not in what the host sends."""
    from converge.facts import batched
    from converge.facts import host as host_facts
    files = {"text": b"a: 1\n", "empty": b"", "binary": bytes(range(256)) * 3, "key": b"s3cret-value\n"}
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "key").chmod(0o600)
    (tmp_path / "folder").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "text")
    asked = {f"{name}": FileState(str(tmp_path / name)) for name in ("text", "empty", "binary", "link", "gone", "folder")}
    asked.update(key=FileState(str(tmp_path / "key"), secret=True), key2=FileState(str(tmp_path / "text"), secret=True),
                 arch=Arch())
    together = Gathering(asked)
    assert len(batched(asked)[1]) == 2 and together.script.count("fact_file_states ") == 2
    output = LocalConnection().run(together.script).stdout
    assert "s3cret" not in output
    found = together.parse(output)
    monkeypatch.setattr(host_facts.FileState, "batch", lambda self: None)
    alone = Gathering(asked)
    assert "fact_file_states " not in alone.script
    assert found.values == alone.parse(LocalConnection().run(alone.script).stdout).values
    assert found["gone"] is None and found["folder"] is None and found["binary"]["size"] == 768
    assert found["link"]["content"] == "a: 1\n" and found["link"]["mode"] == "0777"  # the link's own, as alone
    assert "content" not in found["key"] and found["key"]["mode"] == "0600"


def test_a_batch_that_cannot_be_read_fails_its_facts_not_the_run():
    from converge.facts.host import FILE_STATES, UNIT_STATES, UnitState
    files = [FileState("/etc/a"), FileState("/etc/b")]
    # sizes and bytes disagree (a file rewritten between the stat and the cat)
    gathering = Gathering({"a": files[0], "b": files[1], "arch": Arch()})
    boundary = gathering.boundary
    output = (f"{boundary} begin +0\n@state 644 root root 3 /etc/a\n@state 644 root root 1 /etc/b\n@content\nYQ==\n"
              f"{boundary} end +0 0\n{boundary} begin arch\nx86_64\n{boundary} end arch 0\n{boundary} done\n")
    facts = gathering.parse(output)
    assert facts.values == {"arch": "x86_64"} and "changed while they were read" in facts.errors["a"], facts.errors
    assert FILE_STATES[False].split("@state 644 root root 1 /etc/b\n@content\nYg==", 0, files) == \
        [("absent", 0), ("644 root root 1\nYg==", 0)]
    units = [UnitState("a.service"), UnitState("b.service")]
    shown = "LoadState=loaded\nActiveState=active\n\nLoadState=not-found\nActiveState=inactive\n"
    assert [u.process(*answer) for u, answer in zip(units, UNIT_STATES.split(shown, 0, units))] == \
        [{"LoadState": "loaded", "ActiveState": "active"}, {"LoadState": "not-found", "ActiveState": "inactive"}]
    unit_gathering = Gathering({"a": units[0], "b": units[1]})
    ub = unit_gathering.boundary
    lone = unit_gathering.parse(f"{ub} begin +0\nSystem has not been booted with systemd\n{ub} end +0 1\n{ub} done\n")
    assert set(lone.errors) == {"a", "b"} and "answered 1 of 2 units" in lone.errors["a"], lone.errors


def test_facts_run_side_by_side_and_one_by_one_where_no_temporary_folder_can_be_made(tmp_path):
    class Exits(Arch):
        command = "echo partial; exit 7"

    temp, meet = tmp_path / "tmp", tmp_path / "meet"
    temp.mkdir()
    meet.mkdir()
    gathering = Gathering({"a": _Meets(meet, "a", "b"), "bad": Exits(), "b": _Meets(meet, "b", "a"),
                           "arch": Arch()})
    env = {"PATH": os.environ["PATH"], "TMPDIR": str(temp)}
    side_by_side = gathering.parse(subprocess.run(["sh", "-c", gathering.script], env=env, capture_output=True,
                                                  text=True, timeout=60).stdout)
    assert side_by_side.values == {"a": "together", "bad": "partial", "b": "together", "arch": os.uname().machine}
    assert os.listdir(temp) == []  # the folder went with the facts
    for name in os.listdir(meet):
        os.unlink(meet / name)
    # no temporary folder: one after another, the same answers (the pair could not meet)
    env["TMPDIR"] = str(tmp_path / "absent")
    one_by_one = gathering.parse(subprocess.run(["sh", "-c", gathering.script], env=env, capture_output=True,
                                                text=True, timeout=60).stdout)
    assert one_by_one.values == {"a": "alone", "bad": "partial", "b": "together", "arch": os.uname().machine}
    # a gathering ended by a signal (a lost link's SIGHUP, a SIGTERM) takes its folder with it too
    env["TMPDIR"] = str(temp)
    slow = Gathering({"slow": type("Slow", (Arch,), {"command": "sleep 30"})(), "arch": Arch()})
    for signal in (signal_module.SIGHUP, signal_module.SIGTERM):
        proc = subprocess.Popen(["sh", "-c", slow.script], env=env, start_new_session=True, stdout=subprocess.PIPE)
        for _ in range(100):
            if os.listdir(temp) and len(os.listdir(temp / os.listdir(temp)[0])) == 2:
                break
            time.sleep(0.1)
        assert os.listdir(temp), "the facts never started"
        os.killpg(proc.pid, signal)
        proc.communicate(timeout=30)
        assert os.listdir(temp) == [], signal


def test_atomic_write_keeps_previous_and_reports_no_change_after(tmp_path):
    conn = LocalConnection()
    target = str(tmp_path / "dir" / "unit.service")
    first = File("f", path=target, content="one\n", mode="0640", owner="root", group="root", current=None)
    assert first.needed()
    assert conn.run(first.script()).rc == 0
    state = gather(conn, {"f": FileState(target)})["f"]
    assert state["mode"] == "0640" and state["content"] == "one\n"
    second = File("f", path=target, content="two\n", mode="0640", current=state)
    assert second.needed() and "-one" in second.diff() and "+two" in second.diff()
    assert conn.run(second.script()).rc == 0
    assert open(target).read() == "two\n" and open(target + ".previous").read() == "one\n"
    again = File("f", path=target, content="two\n", mode="0640", current=gather(conn, {"f": FileState(target)})["f"])
    assert not again.needed()
    assert [p for p in os.listdir(tmp_path / "dir") if p.startswith(".")] == []  # no temp file left


def test_secret_file_content_never_leaves_the_host_nor_shows_in_a_diff(tmp_path):
    conn = LocalConnection()
    path = str(tmp_path / "vllm.env")
    secret = File("env", path=path, content="VLLM_API_KEY=s3cr3t\n", mode="0600", secret=True, current=None)
    assert "s3cr3t" not in secret.diff() and "VLLM_API_KEY=********" in secret.diff()
    assert "s3cr3t" not in secret.script()  # base64 in a heredoc on stdin, not on a command line
    conn.run(secret.script())
    state = gather(conn, {"env": FileState(path, secret=True)})["env"]
    assert "content" not in state and state["mode"] == "0600"
    assert mask_secret("A=1\n# c\n", env=True) == "A=********\n# c\n"
    # a PEM's body, or a map's values, may be the secret itself: counted, never shown
    pem = "-----BEGIN PRIVATE KEY-----\nMIIEvQIBADAN=\nBgkqhkiG9w0B\n-----END PRIVATE KEY-----\n"
    assert mask_secret(pem) == "(4 secret lines)\n"
    assert mask_secret("# keys\ngemma4 sk-live-1\n") == "# keys\n(1 secret line)\n"
    tls = File("tls", path=str(tmp_path / "tls.pem"), content=pem, mode="0600", secret=True, current=state)
    assert "MIIEvQ" not in tls.diff() and "PRIVATE" not in tls.diff()


def test_host_lock_is_exclusive_and_released_with_the_connection():
    def take(conn, holder):
        return conn.hold(lock_script("dgemma-test", 0, holder) + KEEP_HOLDING, timeout=10).readline(10)

    first, second = LocalConnection(), LocalConnection()
    assert take(first, "first") == "locked"
    assert take(second, "second").startswith("busy first")
    first.close()
    second.close()
    third = LocalConnection()
    assert take(third, "third") == "locked"
    third.close()


def test_a_read_only_run_takes_no_lock_writes_nothing_and_never_waits():
    """check mode (deploy --check, verify, facts, status): no lock file, folder or holder made;
    a run that holds the lock is named, and the read goes on at once."""
    import time
    from converge.hostlock import LOCK_DIR, peek_script
    name = f"dgemma-peek-{os.getpid()}"
    path = f"{LOCK_DIR}/{name}.lock"

    def peek(conn):
        held, lines = conn.hold(peek_script(name) + "echo facts\n" + KEEP_HOLDING, timeout=10), []
        while not lines or lines[-1] != "facts":
            lines.append(held.readline(10))
        return lines

    reader = LocalConnection()
    assert peek(reader) == ["reading", "facts"]
    assert not os.path.exists(path) and not os.path.exists(path + ".holder")
    deploy = LocalConnection()
    assert deploy.hold(lock_script(name, 0, "a deploy") + KEEP_HOLDING, timeout=10).readline(10) == "locked"
    before = {p: (os.stat(p).st_mtime_ns, open(p).read()) for p in (path, path + ".holder")}
    started = time.monotonic()
    assert peek(LocalConnection()) == ["busy a deploy", "reading", "facts"]
    assert time.monotonic() - started < 5, "a read waits for no deploy"
    assert {p: (os.stat(p).st_mtime_ns, open(p).read()) for p in before} == before
    # and a read under way holds nothing a deploy would wait for
    assert deploy.hold(lock_script(name, 0, "x") + KEEP_HOLDING, timeout=10).readline(10) == "busy a deploy"
    deploy.close()
    assert LocalConnection().hold(lock_script(name, 0, "next") + KEEP_HOLDING, timeout=10).readline(10) == "locked"
    reader.close()
    for leftover in (path, path + ".holder"):
        os.unlink(leftover)


def test_lock_and_facts_share_one_script_that_holds_the_lock_until_closed():
    gathering = Gathering({"arch": Arch(), "mem": MemInfo()})
    conn = LocalConnection()
    held = conn.hold(lock_script("dgemma-test2", 0, "one") + gathering.script + KEEP_HOLDING, timeout=10)
    assert held.readline(10) == "locked"
    output, complete = held.read_until(gathering.done, 10)
    assert complete
    facts = gathering.parse(output)
    assert facts["arch"] == os.uname().machine and facts["mem"]["MemTotal"] > 0
    other = LocalConnection()
    assert other.hold(lock_script("dgemma-test2", 0, "two") + KEEP_HOLDING, timeout=10).readline(10) == "busy one"
    other.close()
    held.close()
    again = LocalConnection()
    assert again.hold(lock_script("dgemma-test2", 0, "three") + KEEP_HOLDING, timeout=10).readline(10) == "locked"
    again.close()


def test_a_script_that_ends_early_is_told_apart_from_one_that_is_slow():
    conn = LocalConnection()
    held = conn.hold("echo one; exit 3\n", timeout=10)
    assert held.read_until("never", 10) == ("one", False)
    slow = conn.hold("echo one; sleep 1\n", timeout=10)
    assert slow.readline(5) == "one"
    try:
        slow.readline(0.3)
    except RemoteCommandError as exc:
        assert exc.rc == 124
    else:
        raise AssertionError("a silent script must time out")
    conn.close()


def test_the_host_lets_the_lock_go_when_the_run_goes_silent():
    """A run whose link died sends no heartbeat: after the patience, the host frees the lock
    (here 1 s, no heartbeat yet); a run that closes frees it at once."""
    import time
    from converge.hostlock import keep_holding
    silent = LocalConnection()
    assert silent.hold(lock_script("dgemma-test3", 0, "silent") + keep_holding(1), timeout=10).readline(10) == \
        "locked"
    time.sleep(2.5)
    other = LocalConnection()
    assert other.hold(lock_script("dgemma-test3", 0, "next") + KEEP_HOLDING, timeout=10).readline(10) == "locked"
    other.close()
    silent.close()


def test_a_host_that_floods_output_is_cut_off_not_buffered_forever():
    from converge.transport import MAX_LINE
    conn = LocalConnection()
    held = conn.hold(f"head -c {MAX_LINE + 100000} /dev/zero | tr '\\\\0' x; sleep 5\n", timeout=10)
    try:
        held.readline(30)
    except RemoteCommandError as exc:
        assert "longer than 16 MiB" in str(exc)
    else:
        raise AssertionError("a line without end must be refused")
    conn.close()


def test_an_http_header_fact_reads_a_live_answer_and_is_none_when_nothing_answers():
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from converge.facts.host import HttpHeader

    class Answer(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(503)
            self.send_header("X-Frontdoor-Generation", "0123456789abcdef")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = HTTPServer(("127.0.0.1", 0), Answer)
    threading.Thread(target=server.handle_request, daemon=True).start()
    port = server.server_address[1]
    try:
        facts = gather(LocalConnection(), {"served": HttpHeader(f"http://127.0.0.1:{port}/health",
                                                                "x-frontdoor-generation")})
        assert facts["served"] == "0123456789abcdef"  # whatever the status: the header is what is asked
    finally:
        server.server_close()
    gone = gather(LocalConnection(), {"served": HttpHeader(f"http://127.0.0.1:{port}/health", "X-Anything")})
    assert gone["served"] is None


def test_an_http_header_fact_asks_again_when_the_answer_is_slow_but_not_when_refused():
    """A host busy for a moment (a 2-core CI machine) answers its front door's /health late:
    that is asked again, not taken for a front door that does not answer (which deploy restarts)."""
    import socket
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from converge.facts.host import HttpHeader

    asked = []

    class Late(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def do_GET(self):
            asked.append(time.monotonic())
            if len(asked) == 1:
                time.sleep(2.5)  # past curl's 2 s: the first try times out
            self.send_response(200)
            self.send_header("X-Frontdoor-Generation", "feedface")
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Late)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        facts = gather(LocalConnection(), {"served": HttpHeader(
            f"http://127.0.0.1:{server.server_address[1]}/health", "X-Frontdoor-Generation")})
        assert facts["served"] == "feedface" and len(asked) == 2
    finally:
        server.shutdown()
        server.server_close()
    # nothing listening: refused, asked once (the command's curl runs once: no second try)
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    fact = HttpHeader(f"http://127.0.0.1:{port}/health", "X-Anything")
    traced = subprocess.run(["sh", "-xc", fact.standalone()], capture_output=True, text=True)
    assert traced.stderr.count("+ curl ") == 1, traced.stderr


def test_an_advisory_hosts_failure_is_reported_and_fails_no_run():
    """Two local hosts, one advisory (off the serving path): it fails, the run does not; the
    recap and the JSON say so; a failure of the other one still fails the run."""
    import io

    from rich.console import Console

    from converge import runner
    from converge.changes import Check, Role
    from converge.report import Report

    def plan(ctx):
        yield Check("works here", ok=ctx.name != "watcher", message="broken on purpose")

    role = Role("probe", lambda v: {}, plan)
    out = io.StringIO()
    report = Report(console=Console(file=out, width=200, color_system=None))
    report.advisory = frozenset({"watcher"})
    targets = [runner.Target(name, {}, lambda: LocalConnection(name).open()) for name in ("server", "watcher")]
    runner.run(targets, [role], report, lock_name=f"advisory-test-{os.getpid()}")
    report.print_recap()
    assert report.recap["watcher"].failed == 1 and not report.failed
    assert report.as_dict()["advisory_failures"] == ["watcher"] and report.as_dict()["ok"] is True
    assert "(advisory: the run does not fail for it)" in out.getvalue()
    report.advisory = frozenset({"server"})
    assert report.failed  # the one that failed is not advisory
