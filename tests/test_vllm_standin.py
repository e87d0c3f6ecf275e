"""The vLLM stand-in (lab/stubs/vllm) at its interfaces, in this process: every route
vLLM 0.33.0 registers by default (lab/stubs/vllm-routes.txt, read in the wheel) answers,
with vLLM's own guard: a key on /v1, /v2, /inference and /cohere only, never on OPTIONS."""
import http.client
import importlib.machinery
import importlib.util
import json
import threading

import pytest

from tests.conftest import ROOT

STUBS = ROOT / "lab" / "stubs"
KEY = "sk-standin-test"


@pytest.fixture(scope="module")
def standin():
    loader = importlib.machinery.SourceFileLoader("vllm_standin", str(STUBS / "vllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("vllm_standin", loader))
    loader.exec_module(module)
    server = module.ThreadingHTTPServer(("127.0.0.1", 0), module.Handler)
    server.daemon_threads = True
    server.api_key, server.model, server.served_name = KEY, "google/diffusiongemma-26B-A4B-it", "gemma"
    server.served_names, server.steps = ["gemma"], 48
    server.routes = module.read_routes(STUBS / "vllm-routes.txt")
    server.started, server.max_model_len, server.canvas, server.canvas_seconds = 0, 8192, 256, 0.0
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
