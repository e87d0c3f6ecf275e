"""`invoke top` without a lab: the snapshot from Prometheus's answers (as its HTTP API writes
them), the snapshot from two readings of a host (the stand-in's /metrics, a front door's stats
page), Prometheus's histogram_quantile, and a view that fits 80 columns."""
import base64
import io
import json
import math

from rich.console import Console

from day2 import exposition, top, top_view

UP = {"__name__": "up", "job": "vllm", "host": "hgx01", "replica": "1", "model": "diffusiongemma",
      "gpu_uuid": "GPU-b"}


def vector(*rows):
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": metric, "value": [1795600000.0, str(value)]} for metric, value in rows]}})


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def answers(alerts: str = "", **sections) -> str:
    """Prometheus's answers as its program's result line says them (day2/host_programs/prometheus.sh)."""
    return "@result " + json.dumps({"answers": {name: b64(text) for name, text in sections.items()},
                                    "alerts": b64(alerts)}) + "\n"


def test_a_snapshot_from_prometheus_joins_each_replica_with_its_gpu_and_gateway_state():
    alerts = json.dumps({"status": "success", "data": {"alerts": [
        {"state": "firing", "labels": {"alertname": "DgemmaReplicaDown", "severity": "critical", "host": "hgx01",
                                       "replica": "0"},
         "annotations": {"summary": "down", "fix": "invoke recover --hosts hgx01 --replica 0"}},
        {"state": "pending", "labels": {"alertname": "DgemmaKvCacheNearlyFull"}, "annotations": {}}]}})
    output = answers(
        alerts=alerts,
        up=vector((UP, 1), ({**UP, "replica": "0", "gpu_uuid": "GPU-a"}, 0)),
        running=vector(({"host": "hgx01", "replica": "1"}, 3)),
        waiting=vector(({"host": "hgx01", "replica": "1"}, 1)),
        tokens=vector(({"host": "hgx01", "replica": "1"}, 250.5)),
        ttft50=vector(({"host": "hgx01", "replica": "1"}, 0.098)),
        ttft95=vector(({"host": "hgx01", "replica": "1"}, "NaN")),
        kv=vector(({"host": "hgx01", "replica": "1"}, 0.02)),
        # 2.1 denoising steps a second, each over a 256-token canvas, one canvas committed every 21 steps
        denoising_steps=vector(({"host": "hgx01", "replica": "1"}, 2.1)),
        canvas_positions=vector(({"host": "hgx01", "replica": "1"}, 537.6)),
        committed_tokens=vector(({"host": "hgx01", "replica": "1"}, 25.6)),
        errors=vector(({"host": "hgx01", "server": "replica1"}, 0.5), ({"host": "hgx01", "server": "flag"}, 9)),
        gpu_util=vector(({"host": "hgx01", "gpu_uuid": "GPU-b"}, 80)),
        gpu_used=vector(({"host": "hgx01", "gpu_uuid": "GPU-b"}, 100000)),
        gpu_free=vector(({"host": "hgx01", "gpu_uuid": "GPU-b"}, 43000)),
        gateway=vector(({"host": "gateway01", "server": "hgx01", "state": "UP"}, 1),
                       ({"host": "gateway02", "server": "hgx01", "state": "NOLB"}, 1)))
    snap = top.snapshot_from_prometheus(output, 1795600000.0, "Prometheus on monitor01")
    zero, one = snap.replicas
    assert (zero.replica, zero.up, zero.running) == (0, False, None)
    assert (one.running, one.waiting, one.tokens_s, one.ttft_p50_s, one.ttft_p95_s) == (3, 1, 250.5, 0.098, None)
    assert (one.kv_cache, one.errors_s, one.gpu_util) == (0.02, 0.5, 80)
    assert (one.gpu_memory_used_mib, one.gpu_memory_total_mib) == (100000, 143000)
    assert (one.steps_per_token, one.canvas_fill) == (0.08203, 0.04762)
    assert zero.steps_per_token is None and zero.canvas_fill is None  # nothing committed in the window
    assert snap.gateway == {"hgx01": "DRAIN"}  # the worst of what the gateways say: one drains it
    assert [a["alertname"] for a in snap.alerts] == ["DgemmaReplicaDown"]  # firing only
    lines = top_view.lines(snap)
    assert all(len(line) <= 80 for line in lines), lines
    assert lines[2].split()[:6] == ["hgx01/0", "dgemma", "down", "-", "-", "-"]
    assert lines[3].split() == ["hgx01/1", "dgemma", "DRAIN", "3", "1", "250", "98ms", "-", "2", "80", "98/140",
                                "0.50", "0.082"]
    assert lines[4].startswith("FIRING DgemmaReplicaDown hgx01/0: invoke recover --hosts hgx01 --replica 0")
    # the live view in an 80-column terminal: the same rows, every header and cell whole
    console = Console(width=80, record=True, color_system=None, file=io.StringIO())
    console.print(top_view.renderable(snap, every=2))
    live = console.export_text().splitlines()
    assert all(len(line) <= 80 for line in live), live
    assert [line.split() for line in live[1:4]] == [line.split() for line in lines[1:4]], live


def stand_in(tokens, buckets, running=2, committed=0):
    """What the vLLM stand-in writes, the lines that matter (``committed``: canvases committed so
    far, each after 21 steps)."""
    lines = [f'vllm:diffusion_num_denoising_steps_total{{model_name="dgemma",engine="0"}} {committed * 21}.0',
             f'vllm:diffusion_num_canvas_positions_total{{model_name="dgemma",engine="0"}} {committed * 21 * 256}.0',
             f'vllm:diffusion_num_committed_tokens_total{{model_name="dgemma",engine="0"}} {committed * 256}.0',
             f'vllm:num_requests_running{{model_name="dgemma",engine="0"}} {running}.0',
             'vllm:num_requests_waiting{model_name="dgemma",engine="0"} 0.0',
             'vllm:kv_cache_usage_perc{model_name="dgemma",engine="0"} 0.25',
             f'vllm:generation_tokens_total{{model_name="dgemma",engine="0"}} {tokens}']
    lines += [f'vllm:time_to_first_token_seconds_bucket{{model_name="dgemma",engine="0",le="{le}"}} {n}'
              for le, n in buckets]
    return "\n".join(lines) + "\n"


def reading(at, tokens, buckets, fivexx, committed=0):
    targets = '[\n{"labels": {"job": "vllm", "replica": "0", "model": "diffusiongemma", "variant": "x", ' \
              '"gpu_uuid": "GPU-a", "__metrics_path__": "/metrics/replica/0", "host": "rtx01"}, ' \
              '"targets": ["10.213.0.12:8000"]}\n]'
    stats = ("# pxname,svname,qcur,qmax,scur,smax,slim,stot,bin,bout,dreq,dresp,ereq,econ,eresp,wretr,wredis,"
             "status,hrsp_5xx\nservers,replica0,0,0,1,1,,10,0,0,0,0,,0,0,0,0,UP," + str(fivexx) + "\n")
    gpu = 'DCGM_FI_DEV_GPU_UTIL{gpu="0",UUID="GPU-a"} 97\nDCGM_FI_DEV_FB_USED{gpu="0",UUID="GPU-a"} 23000\n' \
          'DCGM_FI_DEV_FB_FREE{gpu="0",UUID="GPU-a"} 9607\n'
    output = "@result " + json.dumps({"targets": b64(targets),
                                      "replicas": {"podman-vllm-diffusiongemma.service": b64(stand_in(tokens, buckets, committed=committed))},
                                      "frontdoor": b64(stats), "gpu": b64(gpu)}) + "\n"
    return top.read_host(output, at, {})


def test_a_snapshot_from_the_hosts_takes_rates_and_percentiles_between_two_readings():
    before = reading(100.0, 1000, [("0.1", 10), ("0.25", 10), ("+Inf", 10)], 2, committed=4)
    now = reading(110.0, 3560, [("0.1", 20), ("0.25", 30), ("+Inf", 30)], 3, committed=14)
    (row,) = top.loads_from_readings("rtx01", now, before)
    assert (row.up, row.running, row.kv_cache, row.model, row.gpus) == (True, 2, 0.25, "diffusiongemma", ["GPU-a"])
    assert row.tokens_s == 256.0 and row.errors_s == 0.1
    # 10 answers under 0.1 s, 10 between 0.1 and 0.25 s in the window: p50 0.1, p95 0.235 (linear)
    assert row.ttft_p50_s == 0.1 and math.isclose(row.ttft_p95_s, 0.235)
    assert (row.gpu_util, row.gpu_memory_used_mib, row.gpu_memory_total_mib) == (97, 23000, 32607)
    assert (row.steps_per_token, row.canvas_fill) == (0.08203, 0.04762)  # 21 steps a 256-token canvas
    (first,) = top.loads_from_readings("rtx01", before, None)
    assert first.tokens_s is None and first.ttft_p50_s is None  # one reading: no rate yet
    assert first.steps_per_token is None
    (restarted,) = top.loads_from_readings("rtx01", reading(120.0, 10, [("+Inf", 1)], 3, committed=1), now)
    assert restarted.steps_per_token is None  # the counters went back: no window


def test_histogram_quantile_is_prometheuss():
    cumulative = [(0.1, 10.0), (0.25, 20.0), (math.inf, 20.0)]
    assert exposition.histogram_quantile(0.5, cumulative) == 0.1
    assert math.isclose(exposition.histogram_quantile(0.75, cumulative), 0.175)
    assert exposition.histogram_quantile(0.99, [(1.0, 0.0), (math.inf, 5.0)]) == 1.0  # in +Inf: the highest bound
    assert exposition.histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None  # nothing observed
    # a counter reset between readings: the new reading, not negative counts
    assert exposition.delta([(1.0, 2.0), (math.inf, 2.0)], [(1.0, 9.0), (math.inf, 9.0)]) == [(1.0, 2.0),
                                                                                            (math.inf, 2.0)]
    samples = exposition.parse('a{x="q\\"uote"} 1.5\n# HELP a b\nb 2e3\nc{le="+Inf"} NaN\n')
    assert samples[0] == ("a", {"x": 'q"uote'}, 1.5) and samples[1] == ("b", {}, 2000.0)


def test_the_busiest_keys_from_two_readings_of_each_gateways_usage_service():
    from day2.exposition import parse
    from day2.top import Snapshot, busiest, keys_from_usage
    from day2.top_view import key_lines, lines
    first = parse('dgemma_usage_requests_total{key="alice",user="",model="diffusiongemma"} 10\n'
                  'dgemma_usage_prompt_tokens_total{key="alice",user="",model="diffusiongemma"} 100\n'
                  'dgemma_usage_completion_tokens_total{key="alice",user="",model="diffusiongemma"} 200\n'
                  'dgemma_usage_requests_total{key="owui",user="ann@lab.org",model="gemma4"} 1\n'
                  'dgemma_key_tokens_today{key="alice",user=""} 300\n')
    later = parse('dgemma_usage_requests_total{key="alice",user="",model="diffusiongemma"} 30\n'
                  'dgemma_usage_prompt_tokens_total{key="alice",user="",model="diffusiongemma"} 300\n'
                  'dgemma_usage_completion_tokens_total{key="alice",user="",model="diffusiongemma"} 600\n'
                  'dgemma_usage_requests_total{key="owui",user="ann@lab.org",model="gemma4"} 9\n'
                  'dgemma_key_tokens_today{key="alice",user=""} 900\n')
    keys: dict = {}
    keys_from_usage(keys, later, (100.0, first), 110.0)
    top = busiest(keys)
    assert [(k.key, k.user, k.requests_s, k.tokens_s, k.tokens_today) for k in top] == \
        [("alice", "", 2.0, 60.0, 900), ("owui", "ann@lab.org", 0.8, 0.0, None)]
    shown = key_lines(Snapshot("test", 110.0, keys=top))
    assert shown[1].split() == ["alice", "2.00", "60", "900"] and shown[2].startswith("owui/ann@lab.org")
    assert all(len(line) <= 80 for line in lines(Snapshot("test", 110.0, keys=top)))
