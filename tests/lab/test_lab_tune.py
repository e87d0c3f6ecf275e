"""`invoke tune` on the lab: rtx01's replica rolled to each bound and held out of service while
your prompts run against it alone, with clients spending the fleet through the gateways' shared
address meanwhile (none fails, and the gateways hold rtx01 out); fewer denoising steps per
committed token at a higher bound, read from vLLM's counters; then back on the inventory's
settings and in service (deploy --check changes nothing, verify passes), Ctrl-C in the middle
included; and --apply writing the bound into the inventory with its comments kept."""
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.conftest import ROOT
from tests.lab.conftest import LAB_INVENTORY, deploy_json, frontdoor_stats, invoke, ssh
from tests.lab.test_lab_rollout import Load

HOST = "rtx01"
UNIT = "/etc/systemd/system/podman-vllm-diffusiongemma.service"
PROMPTS = ("# three of your own prompts\n"
           "Summarise the seeds' five traps in two sentences.\n"
           "Write a long story about a GPU lab that runs a diffusion model.\n"
           "What is the capital of France? One word.\n")


def bound_in_unit() -> float:
    text = ssh(HOST, f"cat {UNIT}").stdout
    return float(re.search(r'"diffusion_entropy_bound": ([0-9.]+)', text).group(1))


def replica_state() -> str:
    rows = [r for r in frontdoor_stats(HOST, check=True) if r["pxname"] == "servers" and r["svname"] == "replica0"]
    return rows[0]["status"] if rows else "absent"


@pytest.fixture(scope="module")
def rtx01(lab):
    proc, _ = deploy_json("--hosts", HOST)
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert bound_in_unit() == 0.1
    yield
    # the lab's own settings for the tests after these, whatever a test left
    proc, _ = deploy_json("--hosts", HOST)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_tune_tries_each_bound_on_a_held_replica_with_no_failed_request(rtx01, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text(PROMPTS)
    out, page = tmp_path / "tune.json", tmp_path / "answers.html"
    with Load(clients=3) as load:
        proc = invoke("tune", "--hosts", HOST, "--bounds", "0.05,0.2", "--prompts", prompts, "--json", out,
                      "--answers", page, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    doc = json.loads(out.read_text())
    trials = {t["bound"]: t for t in doc["trials"]}
    assert sorted(trials) == [0.05, 0.2] and doc["restored"] is True and doc["replica"] == 0
    for bound, trial in trials.items():
        assert trial["requests"] == 3 and trial["errors"] == 0 and not trial["failed"], trial
        assert trial["settings"]["diffusion_entropy_bound"] == bound  # what its process ran
        assert trial["committed_tokens"] > 0 and trial["latency_p50_s"] > 0
    # fewer passes a canvas at the higher bound, and so less time
    assert trials[0.2]["steps_per_committed_token"] < trials[0.05]["steps_per_committed_token"], trials
    assert trials[0.2]["canvas_fill"] > trials[0.05]["canvas_fill"]
    text = page.read_text()
    assert text.index("entropy bound 0.05") < text.index("entropy bound 0.2") and "capital of France" in text
    # no user's request failed, and none reached rtx01 on trial settings: the gateways held it out
    assert load.outcomes and not load.failed, load.failed[:5]
    assert {(server, state) for server, state in load.gateway_seen if server == HOST} & {(HOST, "NOLB"),
                                                                                           (HOST, "DRAIN")}
    # back: the inventory's bound, in service; nothing left for deploy to change, verify green
    assert bound_in_unit() == 0.1 and replica_state().startswith("UP")
    check, data = deploy_json("--hosts", HOST, "--check")
    assert check.returncode == 0 and data["hosts"][HOST]["recap"]["changed"] == 0, \
        [t for t in data["hosts"][HOST]["tasks"] if t["status"] == "changed"]
    verify = invoke("verify", "--hosts", HOST, timeout=600)
    assert verify.returncode == 0, verify.stdout[-3000:]
    # status --json: what the bound did since the replica started (its gate's answer at least)
    status = json.loads(invoke("status", "--hosts", HOST, "--json", "-").stdout)
    seen = status["hosts"][HOST]["replicas"][0]["denoising"]
    assert seen["committed_tokens"] >= 256 and 0 < seen["steps_per_committed_token"] < 1, seen
    print(f"tune on {HOST}: steps per committed token 0.05 -> {trials[0.05]['steps_per_committed_token']}, "
          f"0.2 -> {trials[0.2]['steps_per_committed_token']}; p50 {trials[0.05]['latency_p50_s']} s -> "
          f"{trials[0.2]['latency_p50_s']} s; {len(load.outcomes)} requests through the gateways, none failed")


def _as_from_a_terminal():
    """Ctrl-C as a terminal delivers it: a suite started in the background (`./run.sh test &` from a
    script) has SIGINT ignored, and a Python started so ignores it too (it installs its handler only
    over the default)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_in_the_middle_leaves_the_replica_on_its_settings_and_in_service(rtx01, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("".join(f"Write a long story about lab {i}.\n" for i in range(10)))
    env = dict(os.environ, DGEMMA_INVENTORY=str(LAB_INVENTORY), PYTHONUNBUFFERED="1", COLUMNS="200")
    proc = subprocess.Popen([sys.executable, "-m", "invoke", "tune", "--hosts", HOST, "--bounds", "0.05,0.2",
                             "--prompts", str(prompts), "--repeats", "20", "--answers", str(tmp_path / "a.html")],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=_as_from_a_terminal)
    lines, midway = [], threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if "prompt 3/10" in line:
                midway.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert midway.wait(240), "".join(lines)[-3000:]
        assert bound_in_unit() == 0.05  # mid-trial, on the trial's bound
        proc.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C
        assert proc.wait(300) == 130, "".join(lines)[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(10)
    said = "".join(lines)
    assert "Ctrl-C: putting rtx01 back on its settings and in service" in said, said[-3000:]
    assert bound_in_unit() == 0.1 and replica_state().startswith("UP"), said[-3000:]


def test_apply_writes_the_bound_with_its_comments_kept_and_the_replicas_run_it(rtx01, lab_copy):
    own = lab_copy / "host_vars" / "rtx01.yml"
    own.parent.mkdir(exist_ok=True)
    own.write_text("# the RTX 5090 desktop\nmax_num_seqs: 4  # seed 000\ndiffusion_entropy_bound: 0.1  # Google's\n")
    proc = invoke("tune", "--hosts", HOST, "--apply", "0.15", inventory=lab_copy, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert own.read_text() == ("# the RTX 5090 desktop\nmax_num_seqs: 4  # seed 000\n"
                               "diffusion_entropy_bound: 0.15  # Google's\n")
    assert bound_in_unit() == 0.15 and replica_state().startswith("UP")
    status = invoke("status", "--hosts", HOST, "--json", "-", inventory=lab_copy)
    replica = json.loads(status.stdout)["hosts"][HOST]["replicas"][0]
    assert replica["diffusion"]["diffusion_entropy_bound"] == 0.15, replica
    check, data = deploy_json("--hosts", HOST, "--check", inventory=lab_copy)
    assert check.returncode == 0 and data["hosts"][HOST]["recap"]["changed"] == 0
