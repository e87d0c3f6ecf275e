"""Bad command-line input: a clear message and exit 1 or 2, never a traceback, and
nothing reached (the inventory points at hosts that do not exist)."""
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CASES = [
    (["deploy", "--forks", "abc"], "--forks abc: expected a whole number"),
    (["deploy", "--lock-wait", "-3"], "--lock-wait -3: expected a whole number"),
    (["logs", "--lines", "x"], "--lines x: expected a whole number"),
    (["deploy", "--serial", "0"], "--serial 0: expected a count of hosts (1, 2, ...) or a percentage (1% to 100%)"),
    (["deploy", "--serial", "150%"], "--serial 150%: expected a count of hosts"),
    (["deploy", "--serial", "1", "--max-fail", "x"], "--max-fail x: expected a count of hosts"),
    (["deploy", "--max-fail", "1"], "--max-fail 1: it counts the failed hosts of a batch; give --serial too"),
    (["restart", "--replica", "one"], "--replica one: expected a replica's index"),
    (["logs", "--hosts", "nope"], "unknown host or group 'nope' in --hosts"),
    (["bench", "--hosts", "nope"], "unknown host or group 'nope' in --hosts"),
    (["endpoints", "--hosts", "nope"], "unknown host or group 'nope' in --hosts"),
    (["facts", "--json", "/nonexistent/dir/x.json"], "--json /nonexistent/dir/x.json: cannot write there"),
    (["verify", "--junit", "/nonexistent/j.xml"], "--junit /nonexistent/j.xml: cannot write there"),
]


@pytest.mark.parametrize("args,said", CASES, ids=[" ".join(a) for a, _ in CASES])
def test_bad_option_is_a_message_not_a_traceback(args, said):
    proc = subprocess.run([sys.executable, "-m", "invoke", *args, "--inventory", str(ROOT / "inventory")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode in (1, 2) and "Traceback" not in out, out[-2000:]
    assert said in out


def test_whole_number_options_still_take_a_value_in_help():
    proc = subprocess.run([sys.executable, "-m", "invoke", "deploy", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert "--forks=INT" in proc.stdout and "--lock-wait=INT" in proc.stdout


def test_a_port_that_is_not_ssh_is_one_line_not_paramikos_traceback(tmp_path):
    import socket
    import threading
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(4)
    held = []

    def answer():  # something that is not an SSH server: it accepts, then says a line of another protocol
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
            held.append(conn)

    threading.Thread(target=answer, daemon=True).start()
    inventory = tmp_path / "inventory"
    inventory.mkdir()
    (inventory / "hosts.yml").write_text(
        "all:\n  hosts:\n    notssh:\n"
        f"      ansible_host: 127.0.0.1\n      ansible_port: {listener.getsockname()[1]}\n      connect_timeout: 2\n")
    try:
        proc = subprocess.run([sys.executable, "-m", "invoke", "facts", "--hosts", "notssh", "--inventory",
                               str(inventory)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    finally:
        listener.close()
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    assert "notssh" in out and "SSH" in out, out[-3000:]
