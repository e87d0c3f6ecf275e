"""The fleet's Grafana dashboards, written from the panel lists below: `python3 -m grafana.build`
writes grafana/dashboards/*.json (tests/test_grafana.py checks they are what this writes, and
the lab test runs every panel's query against the lab's Prometheus: each must return data).

Three dashboards, linked by their variables: the fleet (every model and gateway), a host
(its GPUs, memory, disk for the weights, its replicas' units), a replica (its load, latency
and the diffusion settings it runs with). Every query reads the names the fleet's Prometheus
scrapes: vLLM's own (vllm:*), HAProxy's exporter (haproxy_*), the node exporter (node_*),
NVIDIA's DCGM names (DCGM_FI_DEV_*: the DCGM exporter's or the nvidia-smi collector's), and
the fleet's own (dgemma_*)."""
from __future__ import annotations

import json
from pathlib import Path

HERE = Path(__file__).parent
DS = {"type": "prometheus", "uid": "${datasource}"}
RATE = "$__rate_interval"


def panel(title, exprs, unit="short", kind="timeseries", w=12, h=8, description=""):
    """A panel: (query, legend) pairs."""
    return {"type": kind, "title": title, "description": description, "datasource": DS,
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {"legend": {"displayMode": "list", "placement": "bottom"}} if kind == "timeseries" else {},
            "targets": [{"datasource": DS, "expr": expr, "legendFormat": legend, "refId": chr(65 + i)}
                        for i, (expr, legend) in enumerate(exprs)],
            "gridPos": {"w": w, "h": h}}


def quantile(q, metric, by, where=""):
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{where}[{RATE}])))"


def per_token(numerator, denominator, where="", by="host, replica"):
    """The ratio of two of a diffusion model's counters over the window (vllm/v1/spec_decode/metrics.py)."""
    return (f"sum by ({by}) (rate(vllm:diffusion_num_{numerator}_total{where}[{RATE}])) / "
            f"sum by ({by}) (rate(vllm:diffusion_num_{denominator}_total{where}[{RATE}]))")


# seed 001: log the entropy bound and the pass count, to see why an output came out rough
STEPS_DOC = ("Denoising steps per committed token (vLLM's diffusion counters): a lower entropy bound asks more "
             "confidence before a token is committed, so more passes a canvas; a higher one commits sooner. "
             "Tune it on your own prompts: invoke tune")
FILL_DOC = ("Committed tokens over the canvas positions the denoising passes evaluated: one over the passes a "
            "canvas took, so it rises with the entropy bound")


def variable(name, query, label, multi=False):
    return {"name": name, "label": label, "type": "query", "datasource": DS,
            "query": {"query": query, "refId": name}, "definition": query, "refresh": 2, "sort": 1,
            "includeAll": multi, "multi": multi, "current": {}}


DATASOURCE = {"name": "datasource", "label": "Prometheus", "type": "datasource", "query": "prometheus",
              "current": {}, "hide": 0}

FLEET = [
    panel("Requests per second through the gateways",
          [(f'sum by (host) (rate(haproxy_frontend_http_requests_total{{job="gateway", proxy="api"}}[{RATE}]))',
            "{{host}}")], "reqps"),
    panel("Share of 5xx answers at the gateways",
          [(f'sum by (host) (rate(haproxy_frontend_http_responses_total{{job="gateway", proxy="api", code="5xx"}}[{RATE}]))'
            f' / sum by (host) (rate(haproxy_frontend_http_responses_total{{job="gateway", proxy="api"}}[{RATE}]))',
            "{{host}}")], "percentunit"),
    panel("Requests running and waiting, per model",
          [("sum by (model) (vllm:num_requests_running)", "{{model}} running"),
           ("sum by (model) (vllm:num_requests_waiting)", "{{model}} waiting")]),
    panel("Generated tokens per second, per model",
          [(f"sum by (model) (rate(vllm:generation_tokens_total[{RATE}]))", "{{model}}")], "short",
          description="A diffusion LM pays per 256-token canvas: tokens per second depend on the answers' length."),
    panel("Time to first token, per model",
          [(quantile(0.5, "vllm:time_to_first_token_seconds", "model"), "{{model}} p50"),
           (quantile(0.95, "vllm:time_to_first_token_seconds", "model"), "{{model}} p95")], "s"),
    panel("End-to-end latency, per model",
          [(quantile(0.5, "vllm:e2e_request_latency_seconds", "model"), "{{model}} p50"),
           (quantile(0.95, "vllm:e2e_request_latency_seconds", "model"), "{{model}} p95")], "s"),
    panel("Replicas answering, per model",
          [('sum by (model) (up{job="vllm"})', "{{model}} up"), ('count by (model) (up{job="vllm"})', "{{model}} of")],
          kind="stat", w=8),
    panel("Hosts in each gateway's pools (UP)",
          [('sum by (host, proxy) (haproxy_server_status{job="gateway", proxy=~"pool_.+", state="UP"})',
            "{{host}} {{proxy}}")], kind="stat", w=8),
    panel("Alerts firing", [('count(ALERTS{alertstate="firing"}) or vector(0)', "firing")], kind="stat", w=8),
    panel("Fallbacks: requests sent to another model",
          [(f'sum by (proxy) (rate(haproxy_backend_http_responses_total{{job="gateway", proxy=~"fallback_.+"}}[{RATE}]))',
            "{{proxy}}")], "reqps"),
    panel("Denoising steps per committed token, per replica and entropy bound",
          [(per_token("denoising_steps", "committed_tokens") + " * on (host, replica) group_left "
            "(diffusion_entropy_bound) max by (host, replica, diffusion_entropy_bound) (dgemma_replica_info)",
            "{{host}} #{{replica}} bound {{diffusion_entropy_bound}}")], "short", w=24, description=STEPS_DOC),
    panel("GPU utilization, per host",
          [("avg by (host) (DCGM_FI_DEV_GPU_UTIL)", "{{host}}")], "percent"),
    panel("Tokens per second, per key and model (the gateways' usage)",
          [(f"sum by (key, model) (rate(dgemma_usage_prompt_tokens_total[{RATE}]) + "
            f"rate(dgemma_usage_completion_tokens_total[{RATE}]))", "{{key}} {{model}}")],
          description="What vLLM's answers said each key used, summed over the gateways: invoke usage"),
    panel("Tokens of today, per key (and a front end's user)",
          [("max by (key, user) (dgemma_key_tokens_today)", "{{key}} {{user}}")],
          description="As the gateways charge them against tokens_per_day: DgemmaKeyNearDailyBudget fires at 90% "
                      "of a key's limit; at 100% its requests get 429 insufficient_quota until 00:00 UTC"),
]

HOST = [
    panel("Replicas: units (1 = in that state)",
          [('dgemma_replica_unit_state{host="$host"} == 1', "replica {{replica}} {{state}}")], kind="stat", w=8),
    panel("This host in the gateways",
          [('haproxy_server_status{job="gateway", server="$host", state=~"UP|DOWN|NOLB|MAINT"} == 1',
            "{{host}} {{proxy}} {{state}}")], kind="stat", w=8),
    panel("Replicas held out of service (roll, drain)",
          [('dgemma_replica_out_of_service{host="$host"}', "replica {{replica}}")], kind="stat", w=8),
    panel("GPU utilization", [('DCGM_FI_DEV_GPU_UTIL{host="$host"}', "GPU {{gpu}}")], "percent"),
    panel("GPU memory used", [('DCGM_FI_DEV_FB_USED{host="$host"} * 1048576', "GPU {{gpu}}"),
                              ('(DCGM_FI_DEV_FB_USED{host="$host"} + DCGM_FI_DEV_FB_FREE{host="$host"}) * 1048576',
                               "GPU {{gpu}} total")], "bytes"),
    panel("GPU temperature and power", [('DCGM_FI_DEV_GPU_TEMP{host="$host"}', "GPU {{gpu}} °C"),
                                        ('DCGM_FI_DEV_POWER_USAGE{host="$host"}', "GPU {{gpu}} W")]),
    panel("GPU clock event reasons (0: none)", [('DCGM_FI_DEV_CLOCKS_EVENT_REASONS{host="$host"}', "GPU {{gpu}}")]),
    panel("CPU busy", [(f'1 - avg(rate(node_cpu_seconds_total{{host="$host", mode="idle"}}[{RATE}]))', "CPU")],
          "percentunit"),
    panel("Memory available", [('node_memory_MemAvailable_bytes{host="$host"}', "available"),
                               ('node_memory_MemTotal_bytes{host="$host"}', "total")], "bytes"),
    panel("Load", [('node_load1{host="$host"}', "1 min"), ('node_load5{host="$host"}', "5 min")]),
    panel("Disk for the weights", [('dgemma_weights_filesystem_avail_bytes{host="$host"}', "free on {{mountpoint}}"),
                                   ('dgemma_weights_filesystem_size_bytes{host="$host"}', "size of {{mountpoint}}")],
          "bytes"),
    panel("The fleet's images and weights, and what invoke prune would free",
          [('dgemma_fleet_disk_bytes{host="$host"}', "{{kind}} take"),
           ('dgemma_prunable_bytes{host="$host"}', "{{kind}}: prune frees")], "bytes"),
    panel("Front door: answers per replica",
          [(f'sum by (server, code) (rate(haproxy_server_http_responses_total{{job="frontdoor", host="$host", '
            f'proxy="servers"}}[{RATE}]))', "{{server}} {{code}}")], "reqps"),
    panel("GPUs placed (1) or left out (0, with the reason)",
          [('dgemma_gpu_placed{host="$host"}', "GPU {{gpu}} {{reason}}")], kind="stat", w=24),
]

R = 'host="$host", replica="$replica"'
REPLICA = [
    panel("Requests running and waiting", [(f"vllm:num_requests_running{{{R}}}", "running"),
                                           (f"vllm:num_requests_waiting{{{R}}}", "waiting")]),
    panel("KV cache used", [(f"vllm:kv_cache_usage_perc{{{R}}}", "KV cache")], "percentunit"),
    panel("Tokens per second", [(f"rate(vllm:generation_tokens_total{{{R}}}[{RATE}])", "generated"),
                                (f"rate(vllm:prompt_tokens_total{{{R}}}[{RATE}])", "prompt")]),
    panel("Time to first token", [(quantile(0.5, "vllm:time_to_first_token_seconds", "host", f"{{{R}}}"), "p50"),
                                  (quantile(0.95, "vllm:time_to_first_token_seconds", "host", f"{{{R}}}"), "p95")],
          "s"),
    panel("End-to-end latency and time in the queue",
          [(quantile(0.5, "vllm:e2e_request_latency_seconds", "host", f"{{{R}}}"), "e2e p50"),
           (quantile(0.95, "vllm:e2e_request_latency_seconds", "host", f"{{{R}}}"), "e2e p95"),
           (quantile(0.95, "vllm:request_queue_time_seconds", "host", f"{{{R}}}"), "queue p95")], "s"),
    panel("Time between tokens (a canvas, for a diffusion LM)",
          [(quantile(0.95, "vllm:inter_token_latency_seconds", "host", f"{{{R}}}"), "p95")], "s"),
    panel("Requests finished, by reason",
          [(f"sum by (finished_reason) (rate(vllm:request_success_total{{{R}}}[{RATE}]))", "{{finished_reason}}")],
          "reqps"),
    panel("Scrape: the replica's /metrics answers (1)", [(f'up{{job="vllm", {R}}}', "up")], kind="stat", w=6),
    panel("Diffusion settings it runs with", [(f"dgemma_replica_info{{{R}}}",
                                               "canvas {{canvas_length}} steps {{max_denoising_steps}} "
                                               "{{diffusion_sampler}} {{diffusion_entropy_bound}} ({{variant}})")],
          kind="stat", w=18),
    panel("Denoising steps per committed token", [(per_token("denoising_steps", "committed_tokens", f"{{{R}}}"),
                                                   "steps per token")], description=STEPS_DOC),
    panel("Canvas fill", [(per_token("committed_tokens", "canvas_positions", f"{{{R}}}"), "committed / evaluated")],
          "percentunit", description=FILL_DOC),
    panel("Its GPU: utilization", [(f'DCGM_FI_DEV_GPU_UTIL * on (host, gpu_uuid) group_left (replica) '
                                    f'max by (host, gpu_uuid, replica) (dgemma_replica_info{{{R}}})', "{{gpu_uuid}}")],
          "percent"),
]

DASHBOARDS = {
    "fleet": ("DiffusionGemma fleet", FLEET, []),
    "host": ("DiffusionGemma fleet: host", HOST,
             [variable("host", 'label_values(up{job=~"node|frontdoor|gateway"}, host)', "Host")]),
    "replica": ("DiffusionGemma fleet: replica", REPLICA,
                [variable("host", 'label_values(up{job="vllm"}, host)', "Host"),
                 variable("replica", 'label_values(up{job="vllm", host="$host"}, replica)', "Replica")]),
}


def dashboard(uid: str, title: str, panels: list, variables: list) -> dict:
    x = y = row_height = 0
    laid = []
    for i, p in enumerate(panels, 1):
        w, h = p["gridPos"]["w"], p["gridPos"]["h"]
        if x + w > 24:
            x, y = 0, y + row_height
            row_height = 0
        laid.append({**p, "id": i, "gridPos": {"x": x, "y": y, "w": w, "h": h}})
        x, row_height = x + w, max(row_height, h)
    links = [{"title": t, "type": "link", "url": f"/d/dgemma-{u}?${{__url_time_range}}&${{host:queryparam}}"}
             for u, (t, _, _) in DASHBOARDS.items() if u != uid]
    return {"uid": f"dgemma-{uid}", "title": title, "tags": ["dgemma", "vllm"], "timezone": "browser",
            "schemaVersion": 39, "version": 1, "refresh": "30s", "time": {"from": "now-1h", "to": "now"},
            "editable": True, "links": links, "panels": laid,
            "templating": {"list": [DATASOURCE, *variables]}}


def render() -> dict[str, str]:
    return {f"{uid}.json": json.dumps(dashboard(uid, title, panels, variables), indent=2) + "\n"
            for uid, (title, panels, variables) in DASHBOARDS.items()}


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / "dashboards" / name).write_text(text)
        print(f"wrote grafana/dashboards/{name}")
