"""`invoke bench`: the seeds' method for a diffusion LM (DOMAIN.md).

Direct API, non-streaming, temperature 0, thinking off per request, warm-up
excluded, tokens from ``usage.completion_tokens``. Three figures, because cost
is per 256-token canvas, not per token: (a) full canvas (~256 tokens forced),
(b) short answers, (c) concurrency 4 aggregate. Each with tok/s, latency p50/p95
and output length. The API key is read from its file and sent only in the
Authorization header.
"""
from __future__ import annotations

import csv
import json
import statistics
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field

FULL_PROMPT = ("Write a long, detailed essay about why the sky is blue, covering Rayleigh scattering, "
               "the solar spectrum and human colour vision. Use at least 256 tokens.")
SHORT_PROMPTS = ["What is the capital of France? One word.", "2 + 2 = ? Answer with the number only.",
                 "Name a primary colour. One word.", "Is water wet? Yes or no."]
PUBLISHED = [  # (GPU name contains, platform, figures) from the seeds
    ("GB10", "DGX Spark (GB10), NVFP4, seed 004",
     {"full_canvas": "158.7 prose / 143.1 code", "short": "~16 (cold, short reply)", "concurrency_4": "257.3"}),
    ("RTX 5090", "RTX 5090, NVFP4, seeds 001/002", {"full_canvas": "700+", "short": "-", "concurrency_4": "-"}),
    ("H100", "H100, FP8 low batch, seeds 001/002", {"full_canvas": "1000-1100+", "short": "-", "concurrency_4": "-"}),
]


@dataclass
class Sample:
    scenario: str
    latency_s: float
    completion_tokens: int
    ok: bool = True
    error: str = ""


@dataclass
class Figure:
    scenario: str
    requests: int
    tok_per_s: float
    latency_p50_s: float
    latency_p95_s: float
    mean_output_tokens: float
    total_tokens: int
    wall_s: float
    errors: int = 0


# the fleet CA, set by the caller: front doors answer https with its certificates
TLS: dict = {}
# the front door sends a request that names a replica to that replica alone (roles/frontdoor)
REPLICA_HEADER = "X-Dgemma-Replica"


@dataclass
class HostBench:
    host: str
    base_url: str
    model: str
    gpu: str | None
    figures: list = field(default_factory=list)
    published: dict | None = None
    replica: int | None = None  # one replica of the host; None: the host's front door, over all of them


def _post(base_url: str, key: str | None, body: dict, timeout: float, replica: int | None = None) -> dict:
    req = urllib.request.Request(f"{base_url}/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    if replica is not None:
        req.add_header(REPLICA_HEADER, str(replica))
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    with urllib.request.urlopen(req, timeout=timeout, context=TLS.get("context")) as resp:
        return json.loads(resp.read())


def request_body(model: str, prompt: str, full: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "stream": False, "max_tokens": 256, "chat_template_kwargs": {"enable_thinking": False}}
    if full:
        body.update(min_tokens=256, ignore_eos=True)  # vLLM sampling extras: fill the canvas
    return body


def one(base_url, key, model, scenario, prompt, full, timeout, replica=None) -> Sample:
    started = time.perf_counter()
    try:
        reply = _post(base_url, key, request_body(model, prompt, full), timeout, replica)
        return Sample(scenario, time.perf_counter() - started, int(reply["usage"]["completion_tokens"]))
    except (urllib.error.URLError, OSError, KeyError, ValueError) as exc:
        return Sample(scenario, time.perf_counter() - started, 0, False, str(exc)[:200])


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def figure(scenario: str, samples: list[Sample], wall: float | None = None) -> Figure:
    good = [s for s in samples if s.ok]
    lat = [s.latency_s for s in good]
    tokens = sum(s.completion_tokens for s in good)
    if wall is None:  # sequential: mean of per-request tok/s
        rate = statistics.mean(s.completion_tokens / s.latency_s for s in good) if good else 0.0
        wall = sum(lat)
    else:  # concurrent: aggregate
        rate = tokens / wall if wall else 0.0
    return Figure(scenario, len(samples), round(rate, 1), round(percentile(lat, 0.5), 3),
                  round(percentile(lat, 0.95), 3), round(tokens / len(good), 1) if good else 0.0, tokens,
                  round(wall, 3), len(samples) - len(good))


def published_for(gpu: str | None) -> dict | None:
    for needle, platform, figures in PUBLISHED:
        if gpu and needle in gpu:
            return {"platform": platform, **figures}
    return None


def run_host(host: str, base_url: str, key: str | None, model: str, gpu: str | None, repeats: int = 4,
             concurrency: int = 4, timeout: float = 300, progress=None, replica: int | None = None,
             diffusion: bool = True) -> HostBench:
    """The three figures through the host's front door for ``model``: over all its replicas, or
    pinned to ``replica``; beside the seeds' figures for a diffusion model (they are DiffusionGemma's)."""
    result = HostBench(host, base_url, model, gpu, published=published_for(gpu) if diffusion else None,
                       replica=replica)
    tick = progress or (lambda text: None)
    tick("warm-up (excluded)")
    one(base_url, key, model, "warmup", FULL_PROMPT, True, timeout, replica)
    samples = []
    for i in range(repeats):
        tick(f"full canvas {i + 1}/{repeats}")
        samples.append(one(base_url, key, model, "full_canvas", FULL_PROMPT, True, timeout, replica))
    result.figures.append(figure("full_canvas", samples))
    samples = []
    for i in range(repeats):
        tick(f"short answer {i + 1}/{repeats}")
        samples.append(one(base_url, key, model, "short", SHORT_PROMPTS[i % len(SHORT_PROMPTS)], False, timeout,
                           replica))
    result.figures.append(figure("short", samples))
    tick(f"concurrency {concurrency}")
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        samples = list(pool.map(lambda _: one(base_url, key, model, f"concurrency_{concurrency}", FULL_PROMPT,
                                              True, timeout, replica), range(concurrency)))
    result.figures.append(figure(f"concurrency_{concurrency}", samples, time.perf_counter() - started))
    return result


def write(results: list[HostBench], json_path: str | None, csv_path: str | None):
    if json_path:
        with open(json_path, "w") as handle:
            json.dump({"method": __doc__.split("\n\n")[1].replace("\n", " "),
                       "hosts": [asdict(r) for r in results]}, handle, indent=2)
    if csv_path:
        with open(csv_path, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["host", "replica", "model", "gpu", "scenario", "requests", "tok_per_s", "latency_p50_s",
                             "latency_p95_s", "mean_output_tokens", "total_tokens", "wall_s", "errors", "published"])
            for r in results:
                for f in r.figures:
                    pub = (r.published or {}).get(f.scenario, "")
                    writer.writerow([r.host, "all" if r.replica is None else r.replica, r.model, r.gpu, f.scenario, f.requests, f.tok_per_s, f.latency_p50_s,
                                     f.latency_p95_s, f.mean_output_tokens, f.total_tokens, f.wall_s, f.errors, pub])
