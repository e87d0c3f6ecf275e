"""The vLLM stand-in's diffusion counters against vLLM 0.33.0's own (lab/stubs/vllm-metrics.json,
read from the wheel by checks/vllm/metric_names.py): the same names, help texts, type and
labels, no family vLLM does not export, moving as vLLM's scheduler moves them; and its
denoising passes following the entropy bound as the field reports describe."""
import http.client
import importlib.machinery
import importlib.util
import json
import re
import threading

import pytest

from tests.conftest import ROOT

STUBS = ROOT / "lab" / "stubs"
RECORD = json.loads((STUBS / "vllm-metrics.json").read_text())
KEY = "sk-standin-test"


def _module():
    loader = importlib.machinery.SourceFileLoader("vllm_standin_diffusion", str(STUBS / "vllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("vllm_standin_diffusion", loader))
    loader.exec_module(module)
    return module


standin = _module()


@pytest.fixture
def serve():
    """A stand-in server of the given model and entropy bound, at no cost a pass."""
    servers = []

    def start(model="google/diffusiongemma-26B-A4B-it", bound=0.1, max_steps=48):
        diffusion = "diffusiongemma" in model
        server = standin.EventLoopServer(("127.0.0.1", 0), standin.Handler,
                                         standin.Engine("gemma", diffusion=diffusion))
        server.api_key, server.model, server.served_name, server.served_names = KEY, model, "gemma", ["gemma"]
        server.routes = standin.read_routes(STUBS / "vllm-routes.txt")
        server.started, server.max_model_len, server.canvas, server.pass_seconds = 0, 8192, 256, 0.0
        server.autoregressive, server.ttft_seconds, server.token_seconds = not diffusion, 0.0, 0.0
        server.steps, server.entropy_bound = max_steps, bound
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()


def call(server, method, path, body=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request(method, path, body=json.dumps(body) if body is not None else None,
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    return response.status, response.read().decode()


def chat(server, content, max_tokens=600, **extra):
    body = {"model": "gemma", "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens, **extra}
    status, text = call(server, "POST", "/v1/chat/completions", body)
    assert status == 200, text
    return json.loads(text)


def families(text: str) -> dict[str, tuple[str, str]]:
    """Each family of an exposition: name (a counter's without _total) -> (type, help)."""
    helps = dict(re.findall(r"^# HELP (\S+) (.*)$", text, re.M))
    out = {}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        if name.endswith("_created"):  # prometheus_client's companion of a counter or histogram
            continue
        family = name.removesuffix("_total") if kind == "counter" else name
        out[family] = (kind, helps.get(name, ""))
    return out


def samples(text: str) -> dict[str, tuple[dict, float]]:
    out = {}
    for name, labels, value in re.findall(r"^([a-zA-Z_:][\w:]*)\{([^}]*)\} (\S+)$", text, re.M):
        out[name] = (dict(re.findall(r'(\w+)="([^"]*)"', labels)), float(value))
    return out


def test_the_diffusion_counters_are_vllms_names_help_type_and_labels(serve):
    server = serve()
    chat(server, "write a long story")
    text = call(server, "GET", "/metrics")[1]
    exported = families(text)
    seen = samples(text)
    assert RECORD["vllm"] == "0.33.0" and len(RECORD["diffusion_counters"]) == 3
    for counter in RECORD["diffusion_counters"]:
        assert exported[counter["name"]] == ("counter", counter["help"])
        labels, _ = seen[counter["name"] + "_total"]
        assert sorted(labels) == sorted(counter["labels"]) and labels["model_name"] == "gemma"
    # no vllm: family that vLLM 0.33.0 does not export
    ours = {name for name in exported if name.startswith("vllm:")}
    assert ours and ours <= set(RECORD["families"]), ours - set(RECORD["families"])


def test_the_counters_move_as_vllms_scheduler_moves_them(serve):
    """Every pass of a canvas is a step over the whole canvas; its commit commits all of it, even
    where the answer ends early (the valid canvas length, not the answer's tokens)."""
    server = serve()
    answer = chat(server, "write a long story")  # 600 tokens: three canvases
    short = chat(server, "hi", max_tokens=8)  # 8 tokens: one canvas
    seen = {name.removeprefix("vllm:diffusion_num_").removesuffix("_total"): value
            for name, (_, value) in samples(call(server, "GET", "/metrics")[1]).items()
            if name.startswith("vllm:diffusion_num_")}
    passes_long = 1 + standin.denoising_steps("entropy_bound", 0.1, 48, "write a long story")
    passes_short = 1 + standin.denoising_steps("entropy_bound", 0.1, 48, "hi")
    assert answer["usage"]["completion_tokens"] == 600 and short["usage"]["completion_tokens"] == 8
    assert seen["committed_tokens"] == 4 * 256
    assert seen["denoising_steps"] == 3 * passes_long + passes_short
    assert seen["canvas_positions"] == seen["denoising_steps"] * 256


def test_n_sequences_each_count_their_canvases(serve):
    server = serve()
    chat(server, "hi", max_tokens=8, n=3)
    seen = samples(call(server, "GET", "/metrics")[1])
    assert seen["vllm:diffusion_num_committed_tokens_total"][1] == 3 * 256


def test_an_autoregressive_model_exports_no_diffusion_counter(serve):
    server = serve(model="google/gemma-4-26B-A4B-it")
    chat(server, "hi", max_tokens=8)
    assert "vllm:diffusion_" not in call(server, "GET", "/metrics")[1]


PROMPTS = ["write a long story", "hi", "Explain Rayleigh scattering.", "Summarise the seeds.", "x" * 300]


def test_a_lower_bound_takes_more_passes_never_more_than_max_denoising_steps():
    for prompt in PROMPTS:
        steps = [standin.denoising_steps("entropy_bound", bound, 48, prompt) for bound in (0.02, 0.05, 0.1, 0.2, 0.5)]
        assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1], (prompt, steps)
        assert all(standin.MIN_DENOISING_STEPS <= s <= 48 for s in steps)
        assert standin.denoising_steps("entropy_bound", 0.0001, 48, prompt) == 48  # capped where vLLM commits anyway
        assert standin.denoising_steps("entropy_bound", 0.0001, 12, prompt) == 12
    at_default = [standin.denoising_steps("entropy_bound", 0.1, 48, p) for p in PROMPTS]
    assert 16 <= min(at_default) and max(at_default) <= 24  # about 20 of 48 at Google's default
    assert len(set(at_default)) > 1  # prompts differ


def test_the_bound_sets_the_pace_and_the_steps_per_committed_token(serve):
    """The steps per committed token that `invoke tune` reads fall as the bound rises, and a
    canvas's time with them (each pass costs the same)."""
    figures = {}
    for bound in (0.05, 0.2):
        server = serve(bound=bound)
        for prompt in PROMPTS:
            chat(server, prompt)
        seen = samples(call(server, "GET", "/metrics")[1])
        figures[bound] = (seen["vllm:diffusion_num_denoising_steps_total"][1]
                          / seen["vllm:diffusion_num_committed_tokens_total"][1])
        server.pass_seconds = 0.001
        assert standin.canvas_seconds(server, 1 + standin.denoising_steps("entropy_bound", bound, 48, "hi")) > 0
    assert figures[0.2] < figures[0.05]
    slow = standin.canvas_seconds(server, 1 + standin.denoising_steps("entropy_bound", 0.05, 48, "hi"))
    fast = standin.canvas_seconds(server, 1 + standin.denoising_steps("entropy_bound", 0.2, 48, "hi"))
    assert fast < slow
