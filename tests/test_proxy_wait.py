"""The wait after an HAProxy reload (roles/frontdoor/proxy.wait_script), run by bash against
stand-ins for systemctl and curl: the reload signalled once more when it has not taken, then
a restart; what the step reports of each."""
import os
import re
import subprocess
from types import SimpleNamespace

import pytest

from converge.errors import StepFailed
from serving.haproxy.steps import _interpret, wait_script
from serving.haproxy.instance import FRONTDOOR

# systemctl: `is-active` says active; every other call is logged. curl: answers as the new
# generation once the log holds as many reloads as $TAKES_AT (0: never), or a restart where
# $RESTART_TAKES is 1.
SYSTEMCTL = """#!/bin/sh
[ "$1" = is-active ] && { echo active; exit 0; }
echo "$*" >> "$STUB_LOG"
"""
CURL = """#!/bin/sh
reloads=$(grep -c '^reload ' "$STUB_LOG" 2>/dev/null)
if { [ "$RESTART_TAKES" = 1 ] && grep -q '^restart ' "$STUB_LOG" 2>/dev/null; } || { [ "$TAKES_AT" -gt 0 ] && [ "$reloads" -ge "$TAKES_AT" ]; }; then
  printf 'HTTP/1.1 200 OK\\r\\nX-Frontdoor-Generation: new\\r\\n\\r\\n'
else
  printf 'HTTP/1.1 200 OK\\r\\nX-Frontdoor-Generation: old\\r\\n\\r\\n'
fi
"""


def _run(tmp_path, takes_at: int, restart_takes: bool = True, timeout: int = 20):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in (("systemctl", SYSTEMCTL), ("curl", CURL), ("journalctl", "#!/bin/sh\n")):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.log"
    ctx = SimpleNamespace(name="rtx01", vars={"ansible_host": "127.0.0.1", "api_port": 8443})
    unit = FRONTDOOR.unit_name(ctx.vars)
    script = wait_script(ctx, FRONTDOOR, "reload", "new", timeout, fallback=True, enable=False, grace=4, again=1,
                         state_file=str(tmp_path / "servers.state"))
    result = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=timeout + 10,
                            env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "STUB_LOG": str(log),
                                 "TAKES_AT": str(takes_at), "RESTART_TAKES": str(int(restart_takes))})
    calls = [line.split()[0] for line in log.read_text().splitlines()]
    report = _interpret(FRONTDOOR, unit, timeout, "answers")(
        SimpleNamespace(rc=result.returncode, stdout=result.stdout, stderr=result.stderr))
    return calls, report, result.stdout


def test_a_reload_that_takes_is_signalled_once(tmp_path):
    calls, report, _ = _run(tmp_path, takes_at=1)
    assert calls == ["reload"] and re.fullmatch(r"answers( in \d+ s)?", report)


def test_a_reload_signal_not_acted_on_is_sent_once_more_and_no_restart_follows(tmp_path):
    calls, report, out = _run(tmp_path, takes_at=2)
    assert calls == ["reload", "reload"], out
    assert re.fullmatch(r"answers in \d+ s; HAProxy acted on the second reload signal, not the first", report)


def test_a_reload_that_never_takes_is_signalled_twice_then_restarted(tmp_path):
    calls, report, out = _run(tmp_path, takes_at=0)
    assert calls == ["reload", "reload", "restart"], out
    assert re.match(r"answers in \d+ s; the reload did not take \(it still answered as old", report)


def test_an_instance_that_never_answers_as_its_files_say_fails_the_step(tmp_path):
    with pytest.raises(StepFailed, match="did not answer with its new configuration within 6 s"):
        _run(tmp_path, takes_at=0, restart_takes=False, timeout=6)
