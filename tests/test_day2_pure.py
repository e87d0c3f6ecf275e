"""Day-2 pieces that need no host: endpoints lines, benchmark arithmetic."""
from pathlib import Path

import pytest

from day2 import benchmark as bench
from day2.endpoints import HIDDEN, YOUR_KEY, api_key, endpoints, open_webui_lines


def test_endpoints_are_the_front_doors_with_the_ca_to_trust(tmp_path):
    key = tmp_path / "k"
    key.write_text("s3cret\n")
    key.chmod(0o644)
    hostvars = {"rtx01": {"ansible_host": "10.0.0.2", "api_key_file": str(key), "credentials_dir": str(tmp_path)}}
    assert api_key(hostvars, show=True)[0] == YOUR_KEY and "is mode 0644" in api_key(hostvars, True)[1]
    key.chmod(0o600)
    hostvars = {"rtx01": {"ansible_host": "10.0.0.2", "api_port": 8000, "api_key_file": str(key),
                          "credentials_dir": str(tmp_path)},
                "h100-01": {"ansible_host": "10.0.0.3", "api_port": 8001, "state": "stopped"},
                "spark01": {"ansible_host": "10.0.0.1", "api_host": "10.0.0.9"}}
    doc = endpoints(hostvars)
    assert doc == {"gateway": None, "ca_file": str(tmp_path / "ca" / "ca.crt"),
                   "hosts": [{"host": "rtx01", "url": "https://10.0.0.2:8000/v1"},
                             {"host": "spark01", "url": "https://10.0.0.9:8000/v1"}], "task_model": None}
    assert api_key(hostvars, show=False) == (HIDDEN, None) and api_key(hostvars, show=True) == ("s3cret", None)
    lines = open_webui_lines(doc, "s3cret")
    assert lines.startswith('OPENAI_API_BASE_URLS="https://10.0.0.2:8000/v1;https://10.0.0.9:8000/v1"\n'
                            'OPENAI_API_KEYS="s3cret;s3cret"\n')
    assert f'AIOHTTP_CLIENT_SSL_CERT_FILE="{tmp_path}/ca/ca.crt"' in lines and "TASK_MODEL_EXTERNAL" not in lines
    # a fleet that serves Gemma 4 too: Open WebUI's own short tasks go to it
    hostvars["spark01"]["models"] = [{"family": "diffusiongemma", "gpus": 1}, {"family": "gemma4"}]
    assert 'TASK_MODEL_EXTERNAL="gemma4"' in open_webui_lines(endpoints(hostvars), "k")
    with_gateway = endpoints(hostvars, {"gateway01": {"ansible_host": "10.0.0.20", "credentials_dir": str(tmp_path)}})
    assert open_webui_lines(with_gateway, "k").startswith('OPENAI_API_BASE_URLS="https://10.0.0.20:8000/v1"\n'
                                                        'OPENAI_API_KEYS="k"\n')
    assert api_key({"a": {}}, show=True) == (YOUR_KEY, None)


def test_bench_figures_follow_the_seeds_method():
    seq = [bench.Sample("full_canvas", 1.613, 256), bench.Sample("full_canvas", 1.789, 256),
           bench.Sample("full_canvas", 1.0, 0, ok=False, error="timeout")]
    fig = bench.figure("full_canvas", seq)
    assert fig.errors == 1 and fig.mean_output_tokens == 256
    assert fig.tok_per_s == round((256 / 1.613 + 256 / 1.789) / 2, 1)  # 158.7 and 143.1 -> mean
    conc = bench.figure("concurrency_4", [bench.Sample("c", 3.98, 256)] * 4, wall=3.98)
    assert conc.tok_per_s == 257.3  # seed 004: 1024 tok / 3.980 s
    assert bench.percentile([1, 2, 3, 4], 0.5) == 2.5
    body = bench.request_body("m", "p", full=True)
    assert body["temperature"] == 0 and body["chat_template_kwargs"] == {"enable_thinking": False}
    assert body["stream"] is False and body["ignore_eos"] is True
    assert bench.published_for("NVIDIA GB10")["concurrency_4"] == "257.3"
    assert bench.published_for("NVIDIA GeForce RTX 5090")["full_canvas"] == "700+"


def test_the_gateway_view_calls_a_draining_host_drain():
    """A capture of the lab's gateway while rtx01's only replica was drained in its front door
    (its /health said 404; the gateway's disable-on-404 made it NOLB)."""
    from day2.readings import parse_stats_csv
    text = (Path(__file__).parent / "fixtures" / "haproxy" / "gateway-stats-rtx01-draining.csv").read_text()
    # the capture predates the gateway's pools: its one backend, `servers`, is DiffusionGemma's pool now
    text = "\n".join("pool_diffusiongemma," + line[len("servers,"):] if line.startswith("servers,") else line
                     for line in text.splitlines())
    states = {(row["server"], row["pool"]): row["state"] for row in parse_stats_csv(text)}
    assert states == {("spark01", "diffusiongemma"): "UP", ("rtx01", "diffusiongemma"): "DRAIN",
                      ("h100-01", "diffusiongemma"): "UP", ("hgx01", "diffusiongemma"): "UP"}


def test_the_front_door_fact_reads_the_same_stats_page():
    """The frontdoor role's fact of its servers' states reads the same CSV, per server."""
    from serving.haproxy.stats import ServerStates
    text = (Path(__file__).parent / "fixtures" / "haproxy" / "gateway-stats-rtx01-draining.csv").read_text()
    states = ServerStates("/run/x.sock").process(text, 0)
    assert states["rtx01"] == {"status": "NOLB", "in_flight": 0} and set(states) == {"spark01", "rtx01", "h100-01",
                                                                                      "hgx01"}
    assert ServerStates("/run/x.sock").process("", 0) == {}
    # a front door: a replica's requests through its family's pool (a tracking server) are its own
    front_door = ("# pxname,svname,qcur,qmax,scur,status\nservers,replica0,0,0,1,DRAIN\nservers,replica1,0,0,0,UP\n"
                  "pool_diffusiongemma,replica0,1,0,2,DRAIN\npool_gemma4,replica1,0,0,0,UP\n"
                  "pool_diffusiongemma,BACKEND,1,0,2,UP\n")
    assert ServerStates("/run/x.sock").process(front_door, 0) == {
        "replica0": {"status": "DRAIN", "in_flight": 4}, "replica1": {"status": "UP", "in_flight": 0}}


def test_status_and_verify_off_a_terminal_print_every_name_whole():
    import io
    from rich.console import Console
    from converge.verify_report import print_table
    from day2.status_table import print_status
    long_check = "start: no_replica_left_drained_in_its_front_door_after_a_roll"
    verify = {"ok": True, "hosts": {"hgx01": {"ok": True, "checks": [
        {"check": long_check, "status": "passed", "message": ""},
        {"check": "gateway: gateway_runs_and_starts_at_boot", "status": "skipped", "message": "n/a"}]}}}
    replica = {"replica": 3, "unit_state": "active/running", "container": "running", "health": "200",
               "frontdoor": "DRAIN", "model": "google/diffusiongemma-26B-A4B-it", "planned": True,
               "gpu_memory_used_mib": 1, "gpu_memory_total_mib": 2}
    status = {"ok": True, "hosts": {
        "a-very-long-host-name-of-the-lab": {"reachable": True, "errors": [], "drift": [], "image": "x/y:tag",
                                             "digest": "sha256:0123", "replicas": [replica]},
        "gateway01": {"reachable": True, "errors": [], "drift": [], "gateway_servers": [
            {"server": "a-very-long-host-name-of-the-lab", "pool": "diffusiongemma", "state": "DRAIN", "check": "L7STS",
             "since_s": 3}]}}}
    for printer, data in ((print_table, verify), (print_status, status)):
        piped = io.StringIO()
        printer(data, Console(file=piped, width=80, force_terminal=False))
        assert "…" not in piped.getvalue()
        narrow = io.StringIO()
        printer(data, Console(file=narrow, width=80, force_terminal=True))
        assert "│" in narrow.getvalue() or "┃" in narrow.getvalue()  # a terminal gets the table
    text = io.StringIO()
    print_table(verify, Console(file=text, width=80, force_terminal=False))
    assert f"hgx01  {long_check}  pass" in text.getvalue()
    text = io.StringIO()
    print_status(status, Console(file=text, width=80, force_terminal=False))
    assert "a-very-long-host-name-of-the-lab unit=active/running" in text.getvalue()
    assert "frontdoor=DRAIN load=- model=diffusiongemma-26B-A4B-it" in text.getvalue()
    assert "gateway gateway01 server=a-very-long-host-name-of-the-lab pool=diffusiongemma state=DRAIN" in text.getvalue()


def test_the_diffusion_settings_in_force_come_from_the_running_command_line():
    """A real capture: rtx01's `podman run` as /proc/PID/cmdline holds it (NUL-separated)."""
    from pathlib import Path

    from day2.status_table import diffusion_text
    from serving.vllm_serve import diffusion_in_force, diffusion_wanted, serve_args
    argv = (Path(__file__).parent / "fixtures/cmdline/rtx01-podman-run.bin").read_bytes().decode().split("\0")
    running = diffusion_in_force(argv)
    assert running == {"canvas_length": 256, "max_denoising_steps": 48, "diffusion_sampler": "entropy_bound",
                       "diffusion_entropy_bound": 0.1}
    assert running == diffusion_wanted({})  # the roles' defaults, as the lab runs them
    # the last occurrence wins, as in vLLM's parser; -dc and --flag=value are read too
    tuned = serve_args({"diffusion_entropy_bound": 0.2, "extra_serve_args": ["-dc", '{"canvas_length": 128}']},
                       "google/diffusiongemma-26B-A4B-it", 0.9, 1, 8100)
    assert diffusion_in_force(tuned) == {"canvas_length": 128, "diffusion_sampler": "entropy_bound",
                                         "diffusion_entropy_bound": 0.2}
    assert diffusion_in_force(["vllm", "serve", '--hf-overrides={"diffusion_sampler": "x"}']) == \
        {"diffusion_sampler": "x"}
    assert diffusion_in_force(["vllm", "serve", "--diffusion-config", "not json"]) is None
    assert diffusion_in_force([]) is None
    assert diffusion_text(running) == "canvas 256 steps 48 entropy_bound 0.1"
    assert diffusion_text(running, ":") == "canvas:256,steps:48,entropy_bound:0.1"
    assert diffusion_text(None) == "-"


def test_the_status_probe_reads_each_replicas_command_line():
    import base64
    import json
    from pathlib import Path

    from day2.readings import ServiceProbe
    raw = (Path(__file__).parent / "fixtures/cmdline/rtx01-podman-run.bin").read_bytes()
    result = {"containers": base64.b64encode(b"vllm-diffusiongemma running\nvllm-diffusiongemma-1 exited\n").decode(),
              "units": {"podman-vllm-diffusiongemma.service": {"argv": base64.b64encode(raw).decode(),
                                                               "health": "200", "load": "2,1,0.0125",
                                                               "denoising": "2100,537600,25600"},
                        "podman-vllm-diffusiongemma-1.service": {"argv": "", "health": "000", "load": ""}}}
    out = ServiceProbe({}).process("@result " + json.dumps(result) + "\n", 0)
    assert out[0]["health"] == "200" and out[0]["diffusion"]["max_denoising_steps"] == 48
    assert out[0]["generation"] == {"max_new_tokens": None}  # its --override-generation-config
    # its load from vLLM's /metrics: two running, one waiting, the KV cache 1.25% full
    assert out[0]["load"] == {"running": 2, "waiting": 1, "kv_cache_usage": 0.0125}
    # what its entropy bound did since it started: 21 steps a committed 256-token canvas
    assert out[0]["denoising"] == {"denoising_steps": 2100, "canvas_positions": 537600, "committed_tokens": 25600,
                                   "steps_per_committed_token": 0.08203, "canvas_fill": 0.04762}
    assert out[1] == {"container": "exited", "health": "000", "load": None, "diffusion": None, "generation": None,
                      "denoising": None}


def test_request_records_take_journalctls_since_and_a_short_one():
    from day2.usage import UsageError, records_command
    assert "SINCE=-30m\n" in records_command("30m", None, 50)  # journalctl reads a bare 30m as nothing
    assert "SINCE='2 hours ago'\n" in records_command("2 hours ago", None, 50)
    with pytest.raises(UsageError, match="write what journalctl takes"):
        records_command("yesterday; rm -rf /", None, 50)
