"""The official OpenAI Python SDK against the lab's gateways, as seed 001's users call the fleet
(the shared address, the fleet CA, a key from the lab): chat and its stream for both models, a
long answer with no max_tokens that is not cut at 256 and arrives in DiffusionGemma's blocks, a
tool round trip that ends in text, /v1/responses, the SDK's own errors for a wrong key and an
unknown model, and its retries carrying a chat across a gateway failover."""
import json
import math
import ssl
import threading
import time

import openai
import pytest

from lab import config, sh
from tests.lab.conftest import CA_FILE, deploy_json
from tests.lab.test_lab_limits import GATEWAYS, SHARED, holder

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def lab_key() -> str:
    return config.API_KEY_FILE.read_text().strip()


def client(key=None, **options) -> openai.OpenAI:
    """As a user sets it up: the gateways' address, the fleet CA, the SDK's defaults otherwise."""
    return openai.OpenAI(base_url=f"https://{SHARED}:8000/v1", api_key=key or lab_key(),
                         http_client=openai.DefaultHttpxClient(verify=ssl.create_default_context(cafile=str(CA_FILE))),
                         **options)


@pytest.fixture(scope="module")
def deployed(lab):
    proc, _ = deploy_json()
    assert proc.returncode == 0, proc.stdout[-3000:]
    return lab


@pytest.mark.parametrize("model", ["diffusiongemma", "gemma4"])
def test_a_chat_a_tool_round_trip_and_a_response_for_each_model(deployed, model):
    sdk = client()
    reply = sdk.chat.completions.create(model=model, messages=[{"role": "user", "content": "Say hi in one sentence."}])
    assert reply.model == model and reply.choices[0].message.content and reply.usage.completion_tokens > 0
    ask = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    first = sdk.chat.completions.create(model=model, messages=ask, tools=[WEATHER])
    assert first.choices[0].finish_reason == "tool_calls"
    [call] = first.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Tokyo"}
    result = {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"city": "Tokyo", "sky": "clear"})}
    second = sdk.chat.completions.create(model=model, messages=ask + [first.choices[0].message.model_dump(), result],
                                         tools=[WEATHER])
    assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content  # it ends in text
    assert not second.choices[0].message.tool_calls
    response = sdk.responses.create(model=model, input="Say hi in one sentence.")
    assert response.status == "completed" and response.output_text


def test_a_long_answer_with_no_max_tokens_is_not_cut_at_256_and_streams_in_blocks(deployed):
    stream = client().chat.completions.create(model="diffusiongemma", stream=True, stream_options={"include_usage": True},
                                              messages=[{"role": "user", "content": "write a long story"}])
    pieces, finish, usage = [], None, None
    for chunk in stream:
        if chunk.choices:
            if chunk.choices[0].delta.content:
                pieces.append(chunk.choices[0].delta.content)
            finish = chunk.choices[0].finish_reason or finish
        elif chunk.usage:
            usage = chunk.usage  # vLLM's usage chunk at the end, as the client asked
    assert finish == "stop" and usage.completion_tokens > 256, (finish, usage)
    assert len("".join(pieces).split()) == usage.completion_tokens
    assert len(pieces) == math.ceil(usage.completion_tokens / 256)  # a 256-token canvas at a time


def test_the_sdks_own_errors(deployed):
    with pytest.raises(openai.AuthenticationError):
        client(key="sk-not-a-lab-key", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError) as caught:
        client(max_retries=0).chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    assert "does not exist" in str(caught.value)
    assert {m.id for m in client().models.list()} >= {"diffusiongemma", "gemma4"}


def test_the_sdks_retries_carry_a_chat_across_a_gateway_failover(deployed):
    """The address's holder loses its link mid-run: the request it had times out or is reset,
    the SDK retries (its own backoff), and the other gateway answers; no request fails."""
    sdk = client(timeout=8, max_retries=4)
    first = holder()
    answered, failed = [], []

    def chats():
        for _ in range(8):
            try:
                raw = sdk.chat.completions.with_raw_response.create(
                    model="diffusiongemma", max_tokens=16, messages=[{"role": "user", "content": "hi"}])
                answered.append((raw.headers.get("x-dgemma-gateway"), raw.parse().choices[0].finish_reason))
            except openai.OpenAIError as exc:
                failed.append(repr(exc))
            time.sleep(0.5)
    runner = threading.Thread(target=chats)
    runner.start()
    while len(answered) + len(failed) < 2 and runner.is_alive():
        time.sleep(0.1)
    link = config.host(first).veth
    sh.run("ip", "link", "set", link, "down")
    try:
        runner.join(120)
    finally:
        sh.run("ip", "link", "set", link, "up")
    other = next(g for g in GATEWAYS if g != first)
    assert not failed and len(answered) == 8, failed
    assert answered[0][0] == first and answered[-1][0] == other, answered


def test_a_parameter_diffusiongemma_ignores_is_named_on_the_answer(deployed):
    """seed 000: "penalty-family parameters are ignored": the front door says so, through the gateways."""
    sdk = client()
    raw = sdk.chat.completions.with_raw_response.create(
        model="diffusiongemma", presence_penalty=0.5, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers.get("x-dgemma-ignored-parameters") == "presence_penalty"
    raw = sdk.chat.completions.with_raw_response.create(
        model="gemma4", presence_penalty=0.5, messages=[{"role": "user", "content": "hi"}])
    assert raw.headers.get("x-dgemma-ignored-parameters") is None  # Gemma 4 applies it
