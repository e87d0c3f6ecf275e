"""The programs of a container of ours beside vLLM (serving/container_unit/files/*.sh) run for
real under sh: systemctl, journalctl and the runtime are stand-ins on a PATH of their own that
log what they are asked; curl and the HTTP servers it asks are real."""
from __future__ import annotations

import os
import re
import subprocess
import time

from converge.errors import StepFailed
from converge.transport import Result
from serving.relay_probe import fallback_note
from serving.container_unit import Container, _interpret, answering_script, pull_script
from tests.test_day2_programs import Pages, closed_port

UNIT = "podman-dgemma-prometheus.service"


def host(tmp_path, active="active", runtime_fails_relay=False) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls"
    (bin_dir / "systemctl").write_text(f'#!/bin/sh\necho "systemctl $*" >> {log}\n'
                                       f'[ "$1" = is-active ] && echo {active}\nexit 0\n')
    (bin_dir / "journalctl").write_text("#!/bin/sh\necho 'level=error msg=\"bad config\"'\n")
    (bin_dir / "podman").write_text(
        f'#!/bin/sh\necho "podman $*" >> {log}\n'
        + ('[ "$3" = --tls-verify=false ] && { echo "Error: relay refused" >&2; exit 125; }\n'
           if runtime_fails_relay else "") + "exit 0\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    return {"env": {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}, "log": log}


def run(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["sh", "-s"], input=script, capture_output=True, text=True, timeout=60, env=env)


def calls(h: dict) -> list[str]:
    return h["log"].read_text().splitlines() if h["log"].exists() else []


def prometheus(port_pages: Pages) -> Container:
    return Container("dgemma-prometheus", "Prometheus", "prom/prometheus:v2", reload_signal="SIGHUP",
                     ready_url=port_pages.url("/-/ready"), reloaded="prometheus", metrics_url=port_pages.url("/metrics"))


def test_a_reload_is_waited_for_until_the_program_says_it_read_its_files_since(tmp_path):
    reloaded_at = {"t": 0}
    pages = Pages({"/-/ready": (200, "ok"), "/metrics": (200, lambda path: (
        "prometheus_config_last_reload_successful 1\n"
        f"prometheus_config_last_reload_success_timestamp_seconds {reloaded_at['t']}\n"))})
    try:
        h = host(tmp_path)
        # its last reload is older than the step: not ready, until the timeout
        out = run(answering_script(UNIT, prometheus(pages), "reload", 1), h["env"])
        assert out.returncode == 4 and '"state": "timeout"' in out.stdout and "  | level=error" in out.stdout, out.stdout
        assert calls(h)[:2] == [f"systemctl enable {UNIT}", f"systemctl reload {UNIT}"]
        reloaded_at["t"] = int(time.time()) + 5  # now it says it reloaded after the step began
        out = run(answering_script(UNIT, prometheus(pages), "reload", 10), h["env"])
        assert out.returncode == 0 and out.stdout.startswith('@result {"state": "ready"'), out.stdout
        with_reason = _interpret(UNIT, 10, "its files changed")(Result(out.returncode, out.stdout, ""))
        assert re.fullmatch(rf"{UNIT} answers( after \d+ s)? \(its files changed\)", with_reason), with_reason
    finally:
        pages.close()


def test_a_unit_that_fails_is_said_so_with_its_last_log_lines(tmp_path):
    h = host(tmp_path, active="failed")
    exporter = Container("dgemma-node-exporter", "node exporter", "prom/node-exporter:v1.5.0",
                         ready_url=f"http://127.0.0.1:{closed_port()}/metrics")
    out = run(answering_script("podman-dgemma-node-exporter.service", exporter, "start", 30), h["env"])
    assert out.returncode == 3, out.stdout
    assert [c for c in calls(h) if not c.startswith("systemctl is-active")] == [
        "systemctl daemon-reload", "systemctl enable podman-dgemma-node-exporter.service",
        "systemctl reset-failed podman-dgemma-node-exporter.service",
        "systemctl start podman-dgemma-node-exporter.service"]
    try:
        _interpret("podman-dgemma-node-exporter.service", 30, "was inactive")(Result(3, out.stdout, ""))
    except StepFailed as exc:
        # the seconds are the machine's (a loaded one takes one): the failure, not its time, is the point
        assert re.search(r"\(its unit failed after \d+ s\)", str(exc)) and "level=error" in str(exc), str(exc)
    else:
        raise AssertionError("a failed unit read as answering")
    # enabled alone: no start, no wait
    h2 = host(tmp_path / "2")
    out = run(answering_script("podman-dgemma-node-exporter.service", exporter, "none", 30), h2["env"])
    assert out.returncode == 0 and calls(h2) == ["systemctl enable podman-dgemma-node-exporter.service"]


def test_an_image_through_the_relay_or_from_the_registry_when_it_fails(tmp_path):
    ref, relayed = "10.213.0.1:5000/prom/prometheus:v2", "10.213.0.1:7001/prom/prometheus:v2"
    h = host(tmp_path)
    out = run(pull_script("podman", ref, relayed), h["env"])
    assert out.returncode == 0 and fallback_note(out.stdout) == ""
    assert calls(h) == [f"podman pull -q --tls-verify=false {relayed}", f"podman tag {relayed} {ref}",
                        f"podman untag {relayed} {relayed}"]
    failing = host(tmp_path / "f", runtime_fails_relay=True)
    out = run(pull_script("podman", ref, relayed), failing["env"])
    assert out.returncode == 0 and "relay refused" in fallback_note(out.stdout), out.stdout
    assert calls(failing)[-1] == f"podman pull -q {ref}"
    alone = host(tmp_path / "a")
    assert run(pull_script("podman", ref, None), alone["env"]).returncode == 0
    assert calls(alone) == [f"podman pull -q {ref}"]


def test_a_pull_that_fails_fails_its_step_with_the_runtimes_words_and_what_to_do():
    import pytest
    from serving.container_unit import pulled
    from serving.leftovers import removed
    ref = "10.213.0.1:5000/prom/alertmanager:v0.25.0"
    assert pulled(Result(0, "", ""), "docker", ref, "") == f"{ref} pulled"
    with pytest.raises(StepFailed) as arch:
        pulled(Result(1, "", "no matching manifest for linux/arm64 in the manifest list entries\n"), "docker", ref, "")
    assert "exit 1" in str(arch.value) and "linux/arm64" in str(arch.value) and "architecture" in str(arch.value)
    with pytest.raises(StepFailed) as other:
        pulled(Result(125, "", "Error: initializing source: connection refused\n"), "podman", ref, "")
    assert "connection refused" in str(other.value) and "reaches the registry" in str(other.value)
    # the removal of what a role left: the same for its program's end
    assert removed(Result(0, "", ""), "gone") == "gone"
    with pytest.raises(StepFailed, match=r"exit 1\): rm: cannot remove"):
        removed(Result(1, "", "rm: cannot remove '/etc/dgemma/gateway': Device or resource busy\n"), "gone")
