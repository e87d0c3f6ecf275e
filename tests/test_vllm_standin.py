"""The vLLM stand-in (lab/stubs/vllm) at its interfaces, in this process: every route
vLLM 0.33.0 registers by default (lab/stubs/vllm-routes.txt, read in the wheel) answers,
with vLLM's own guard: a key on /v1, /v2, /inference and /cohere only, never on OPTIONS."""
import http.client
import importlib.machinery
import importlib.util
import json
import shutil
import subprocess
import threading
import time

import pytest

from tests.conftest import ROOT

STUBS = ROOT / "lab" / "stubs"
KEY = "sk-standin-test"


@pytest.fixture(scope="module")
def standin():
    loader = importlib.machinery.SourceFileLoader("vllm_standin", str(STUBS / "vllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("vllm_standin", loader))
    loader.exec_module(module)
    server = module.EventLoopServer(("127.0.0.1", 0), module.Handler)
    server.api_key, server.model, server.served_name = KEY, "google/diffusiongemma-26B-A4B-it", "gemma"
    server.served_names, server.steps = ["gemma"], 48
    server.routes = module.read_routes(STUBS / "vllm-routes.txt")
    server.started, server.max_model_len, server.canvas, server.pass_seconds = 0, 8192, 256, 0.0
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def call(server, method, path, body=None, key=None, scheme="Bearer"):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"{scheme} {key}"
    conn.request(method, path, body=json.dumps(body) if body is not None else None, headers=headers)
    response = conn.getresponse()
    return response.status, response.read()


def example(path):
    return path.replace("{id}", "resp_0")


CHAT = {"model": "gemma", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def test_every_default_route_answers_and_only_guarded_prefixes_ask_a_key(standin):
    guarded = ("/v1", "/v2", "/inference", "/cohere")
    for method, path in standin.routes:
        body = CHAT if method == "POST" else None
        status, text = call(standin, method, example(path), body)
        if path.startswith(guarded):
            assert status == 401 and json.loads(text) == {"error": "Unauthorized"}, (method, path)
            status, text = call(standin, method, example(path), body, key=KEY)
        assert status not in (401, 405) and text != b'{"detail": "Not Found"}', (method, path, status, text)


def test_the_open_routes_do_what_vllms_do_without_a_key(standin):
    status, text = call(standin, "POST", "/invocations", CHAT)  # SageMaker's route runs a chat completion
    assert status == 200 and json.loads(text)["object"] == "chat.completion"
    status, text = call(standin, "POST", "/invocations", {"model": "gemma", "prompt": "hi", "max_tokens": 4})
    assert status == 200 and json.loads(text)["object"] == "text_completion"
    assert json.loads(call(standin, "POST", "/tokenize", {"prompt": "a b c"})[1])["count"] == 3
    assert call(standin, "POST", "/scale_elastic_ep", {})[0] == 400
    assert b"vllm:num_requests_running" in call(standin, "GET", "/metrics")[1]


def test_the_guard_is_vllms(standin):
    assert call(standin, "GET", "/v1/models", key=KEY, scheme="bearer")[0] == 200  # scheme case-insensitive
    assert call(standin, "GET", "/v1/models", key="sk-wrong")[0] == 401
    assert call(standin, "GET", "/v1/nothing-here")[0] == 401  # the guard comes before routing
    assert call(standin, "GET", "/v1/nothing-here", key=KEY)[0] == 404
    assert call(standin, "OPTIONS", "/v1/models")[0] != 401  # OPTIONS passes with no key
    assert call(standin, "GET", "/invocations")[0] == 405  # a route of another method
    assert call(standin, "GET", "/nothing-here")[0] == 404


@pytest.fixture
def slow_canvases(standin):
    # a canvas of the fewest passes a prompt takes at the default bound (20 x 0.85, and the commit): 0.4 s
    standin.pass_seconds = 0.4 / 18
    yield 0.4
    standin.pass_seconds = 0.0


def test_generations_wait_side_by_side_on_the_one_event_loop(standin, slow_canvases):
    """As uvicorn: a generation's wait blocks no other connection; while two wait, /load says 2."""
    results, loads = [], []

    def chat():
        results.append(call(standin, "POST", "/v1/chat/completions", CHAT, key=KEY)[0])

    started = time.perf_counter()
    clients = [threading.Thread(target=chat) for _ in range(2)]
    for client in clients:
        client.start()
    time.sleep(slow_canvases / 2)
    loads.append(json.loads(call(standin, "GET", "/load")[1])["server_load"])
    for client in clients:
        client.join()
    elapsed = time.perf_counter() - started
    assert results == [200, 200] and loads == [2]
    assert slow_canvases <= elapsed < 2 * slow_canvases, elapsed  # side by side, not one after the other
    assert json.loads(call(standin, "GET", "/load")[1])["server_load"] == 0


def test_a_stream_arrives_canvas_by_canvas_on_a_kept_alive_connection(standin, slow_canvases):
    conn = http.client.HTTPConnection("127.0.0.1", standin.server_address[1], timeout=10)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    body = dict(CHAT, stream=True, max_tokens=600, messages=[{"role": "user", "content": "write a long story"}])
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    started, arrivals = time.perf_counter(), []
    for line in response:
        if line.startswith(b"data: ") and b'"content": "token' in line:
            arrivals.append(time.perf_counter() - started)
    assert response.status == 200 and len(arrivals) == 3  # 600 tokens: three 256-token canvases
    assert arrivals[1] - arrivals[0] >= slow_canvases * 0.8 and arrivals[2] - arrivals[1] >= slow_canvases * 0.8
    conn.request("GET", "/v1/models", headers=headers)  # the same connection serves the next request
    assert conn.getresponse().status == 200


def test_an_idle_kept_alive_connection_is_closed_as_vllm_closes_it(standin, monkeypatch):
    """vLLM 0.33.0 runs uvicorn with timeout_keep_alive=VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s):
    a connection idle that long after an answer is closed (a proxy's pool meets this)."""
    monkeypatch.setattr(standin, "keep_alive", 0.3)
    conn = http.client.HTTPConnection("127.0.0.1", standin.server_address[1], timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().read() == b""
    conn.request("GET", "/health")  # within the time: the same connection answers
    assert conn.getresponse().status == 200
    time.sleep(0.6)
    assert conn.sock.recv(1) == b""  # the server closed it


@pytest.fixture
def autoregressive(standin):
    """The stand-in as it serves Gemma 4 26B-A4B-it: a first token, then a steady rate."""
    standin.autoregressive, standin.ttft_seconds, standin.token_seconds = True, 0.2, 0.05
    yield standin
    standin.autoregressive = False


def test_an_autoregressive_model_pays_per_token_and_streams_token_by_token(autoregressive):
    started = time.perf_counter()
    assert call(autoregressive, "POST", "/v1/chat/completions", dict(CHAT, max_tokens=8), key=KEY)[0] == 200
    took = time.perf_counter() - started
    assert 0.2 + 8 * 0.05 <= took < 0.2 + 8 * 0.05 + 0.3, took  # 8 tokens: the first after 0.2 s, then 0.05 s each
    conn = http.client.HTTPConnection("127.0.0.1", autoregressive.server_address[1], timeout=10)
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    started, arrivals = time.perf_counter(), []  # before the request: a late reader cannot shorten a time
    conn.request("POST", "/v1/chat/completions", body=json.dumps(dict(CHAT, stream=True, max_tokens=6)),
                 headers=headers)
    response = conn.getresponse()
    for line in response:
        if line.startswith(b"data: ") and b'"content": "token' in line:
            arrivals.append(time.perf_counter() - started)
    conn.close()  # its coroutine on the stand-in's loop ends now, not at the loop's close
    # one chunk per token, the first after the prefill (0.2 s), each a token's time (0.05 s) after
    # the one before; bounds from below alone: a loaded machine delays a chunk's reading, and two
    # may then come together (a gap of 0.02 s after a late one), but none comes before its time
    assert len(arrivals) == 6 and all(at >= 0.18 + i * 0.045 for i, at in enumerate(arrivals)), arrivals
    assert arrivals[-1] - arrivals[0] >= 0.125, arrivals  # streamed as made, not all at the end
    # a name it does not serve: vLLM's own 404 body
    status, body = call(autoregressive, "POST", "/v1/chat/completions", dict(CHAT, model="gemma-4"), key=KEY)
    error = json.loads(body)["error"]
    assert status == 404 and error["message"].startswith("The model `gemma-4` does not exist. Valid aliases: ")
    assert (error["type"], error["param"], error["code"]) == ("NotFoundError", "model", 404)


def _samples(text: str) -> dict:
    """Prometheus text -> {'name{labels}': value} (comments dropped)."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def test_metrics_are_vllms_names_and_follow_the_load(standin, slow_canvases):
    """vLLM 0.33.0's series (vllm/v1/metrics/loggers.py): with --max-num-seqs 1, of two
    requests one runs and one waits, the KV cache holds the running one; once both are done the
    counters and histograms count them, the wait in the queue time and the time to first token."""
    loader = importlib.machinery.SourceFileLoader("vllm_standin", str(STUBS / "vllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("vllm_standin", loader))
    loader.exec_module(module)
    standin.engine = module.Engine("gemma", max_num_seqs=1, kv_tokens=1000)
    base = 'model_name="gemma",engine="0"'
    results = []
    clients = [threading.Thread(target=lambda: results.append(call(standin, "POST", "/v1/chat/completions", CHAT,
                                                                     key=KEY)[0])) for _ in range(2)]
    for client in clients:
        client.start()
    time.sleep(slow_canvases / 2)
    during = _samples(call(standin, "GET", "/metrics")[1].decode())
    for client in clients:
        client.join()
    status, text = call(standin, "GET", "/metrics")
    after = _samples(text.decode())
    assert results == [200, 200]
    assert during[f"vllm:num_requests_running{{{base}}}"] == 1 and during[f"vllm:num_requests_waiting{{{base}}}"] == 1
    assert 0 < during[f"vllm:kv_cache_usage_perc{{{base}}}"] <= 1
    assert after[f"vllm:num_requests_running{{{base}}}"] == after[f"vllm:num_requests_waiting{{{base}}}"] == 0
    assert after[f"vllm:kv_cache_usage_perc{{{base}}}"] == 0
    assert after[f'vllm:request_success_total{{{base},finished_reason="length"}}'] == 2  # max_tokens reached
    assert after[f"vllm:generation_tokens_total{{{base}}}"] == 16  # 8 tokens each
    assert after[f"vllm:e2e_request_latency_seconds_count{{{base}}}"] == 2
    # the second waited for the first: its queue time is a canvas, its first token after two
    assert after[f"vllm:request_queue_time_seconds_sum{{{base}}}"] >= slow_canvases * 0.8
    assert after[f"vllm:time_to_first_token_seconds_sum{{{base}}}"] >= slow_canvases * 2.6
    assert after[f'vllm:time_to_first_token_seconds_bucket{{{base},le="+Inf"}}'] == 2
    assert after['http_requests_total{handler="/v1/chat/completions",method="POST",status="2xx"}'] == 2
    assert not any(k.startswith('http_requests_total{handler="/metrics"') for k in after)  # not instrumented
    assert after["process_start_time_seconds"] > 1.6e9
    if shutil.which("promtool"):  # the text parses as Prometheus reads it (vLLM's names have colons)
        check = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True)
        assert b"error" not in check.stdout + check.stderr.lower()


def test_n_choices_each_count_their_own_tokens_in_a_stream_and_the_last_chunk_sums_them(standin, monkeypatch):
    """As vLLM with n > 1 (serving_chat.py): n choices, a whole answer's usage their sum; in a stream
    forced to carry usage (--enable-force-include-usage), each chunk the count of its own choice,
    and the last chunk, with no choices, the whole."""
    monkeypatch.setattr(standin, "force_include_usage", True)
    status, body = call(standin, "POST", "/v1/chat/completions", dict(CHAT, n=3), key=KEY)[:2]
    answer = json.loads(body)
    assert status == 200 and [c["index"] for c in answer["choices"]] == [0, 1, 2]
    one = len(answer["choices"][0]["message"]["content"].split())
    assert answer["usage"]["completion_tokens"] == 3 * one
    status, body = call(standin, "POST", "/v1/chat/completions", dict(CHAT, n=3, stream=True), key=KEY)[:2]
    events = [json.loads(line[6:]) for line in body.decode().split("\n\n") if line.startswith("data: {")]
    counts: dict = {}
    for event in events[:-1]:
        (choice,) = event["choices"]
        assert event["usage"]["completion_tokens"] >= counts.get(choice["index"], 0)
        counts[choice["index"]] = event["usage"]["completion_tokens"]
    assert counts == {0: one, 1: one, 2: one}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 3 * one
    completions = json.loads(call(standin, "POST", "/v1/completions", {"model": "gemma", "prompt": "hi", "n": 2,
                                                                      "max_tokens": 8}, key=KEY)[1])
    assert len(completions["choices"]) == 2 and completions["usage"]["completion_tokens"] == 2 * one


def test_completions_and_responses_stream_in_vllms_shapes_and_the_sdk_reads_them(standin, monkeypatch):
    """/v1/completions and /v1/responses stream as vLLM 0.33.0 streams them, read here by the
    OpenAI SDK: text_completion chunks a canvas at a time with no usage unless asked (then a last
    chunk of its own, `choices: []`), each choice's own count in each chunk when forced; the
    Responses API's named events in order, numbered, its usage in response.completed alone."""
    import openai

    sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{standin.server_address[1]}/v1", api_key=KEY, max_retries=0)
    full = {"model": "gemma", "max_tokens": 600, "extra_body": {"ignore_eos": True}}
    chunks = list(sdk.completions.create(prompt="the lab", stream=True, **full))
    assert [len(c.choices[0].text.split()) for c in chunks] == [256, 256, 88]  # a canvas a chunk
    assert [c.choices[0].finish_reason for c in chunks] == [None, None, "length"]
    assert all(c.usage is None and c.object == "text_completion" for c in chunks)
    asked = list(sdk.completions.create(prompt="the lab", stream=True, stream_options={"include_usage": True}, **full))
    assert asked[-1].choices == [] and asked[-1].usage.completion_tokens == 600
    assert asked[-1].usage.prompt_tokens == 2 and all(c.usage is None for c in asked[:-1])
    monkeypatch.setattr(standin, "force_include_usage", True)
    counts: dict = {}
    forced = list(sdk.completions.create(prompt="the lab", stream=True, n=2, **full))
    for chunk in forced[:-1]:  # each chunk: its own choice's count so far
        (choice,) = chunk.choices
        assert chunk.usage.completion_tokens > counts.get(choice.index, 0)
        counts[choice.index] = chunk.usage.completion_tokens
    assert counts == {0: 600, 1: 600} and forced[-1].usage.completion_tokens == 1200
    monkeypatch.setattr(standin, "force_include_usage", False)

    events = list(sdk.responses.create(model="gemma", input="the lab", max_output_tokens=300, stream=True,
                                       extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"], kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    done = events[-1].response
    assert len(text.split()) == 300 and done.output_text == text and done.status == "completed"
    assert (done.usage.input_tokens, done.usage.output_tokens, done.usage.total_tokens) == (6, 300, 306)
    assert all(getattr(e, "response", None) is None or e.response.usage is None for e in events[:-1])
