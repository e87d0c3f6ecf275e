"""The vLLM stand-in at the chat interface, as vLLM 0.33.0 and a model behind it answer: tool
calls whose arguments follow each tool's JSON schema, a text answer once the tools' results are
in, tool_choice and parallel_tool_calls as vLLM applies them (chat_completion/message_assembly.py,
serve/utils/tool_calls_utils.py), its 400s for bad tools (protocol.py check_tool_usage), calls
streamed as its parsers stream them (tool_parsers/streaming.py), and the default max_tokens from
the checkpoint's generation config and --override-generation-config (config/model.py). The
answers are read with the official OpenAI SDK's own types, as its users' code reads them."""
import http.client
import importlib.machinery
import importlib.util
import json
import threading

import openai
import pytest
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.conftest import ROOT

STUBS = ROOT / "lab" / "stubs"
KEY = "sk-standin-chat"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}, "detailed": {"type": "boolean"}},
        "required": ["city", "unit", "days"]}}}
TIMESTAMP = {"type": "function", "function": {"name": "get_current_timestamp", "description": "the time now",
                                              "parameters": {"type": "object", "properties": {}}}}
NOTES = {"type": "function", "function": {"name": "search_notes", "parameters": {
    "type": "object", "properties": {"query": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["query"]}}}
ASK_WEATHER = [{"role": "user", "content": "What is the weather in Tokyo?"}]


def load_standin():
    loader = importlib.machinery.SourceFileLoader("vllm_standin_chat", str(STUBS / "vllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("vllm_standin_chat", loader))
    loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def module():
    return load_standin()


@pytest.fixture(scope="module")
def standin(module):
    server = module.EventLoopServer(("127.0.0.1", 0), module.Handler)
    server.api_key, server.model, server.served_name = KEY, "google/diffusiongemma-26B-A4B-it", "diffusiongemma"
    server.served_names, server.steps, server.autoregressive = ["diffusiongemma"], 48, False
    server.routes = module.read_routes(STUBS / "vllm-routes.txt")
    server.started, server.max_model_len, server.canvas, server.pass_seconds = 0, 8192, 256, 0.0
    server.force_include_usage, server.auto_tools = False, True
    # DiffusionGemma's generation_config.json (lab/hubdata.py) with the replicas' override
    server.sampling_defaults = module.vllm_chat.sampling_defaults({"max_new_tokens": 256, "do_sample": False},
                                                                  {"max_new_tokens": None})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def chat(server, **body):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("POST", "/v1/chat/completions", body=json.dumps({"model": "diffusiongemma", **body}),
                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    response = conn.getresponse()
    raw = response.read()
    if body.get("stream") and response.status == 200:
        return response.status, [json.loads(line[6:]) for line in raw.decode().splitlines()
                                 if line.startswith("data: {")]
    return response.status, json.loads(raw)


def completion(server, **body) -> ChatCompletion:
    status, data = chat(server, **body)
    assert status == 200, data
    return ChatCompletion.model_validate(data)


def test_a_tool_round_trip_ends_in_text(standin):
    first = completion(standin, messages=ASK_WEATHER, tools=[TIMESTAMP, WEATHER])
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls  # the tool the question asks for, not the first one offered
    assert call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
    # the schema's required properties, of their types: a string from the question, an enum's
    # value, an integer within its bounds; nothing the schema does not have
    assert json.loads(call.function.arguments) == {"city": "Tokyo", "unit": "celsius", "days": 1}
    for result in ("18 degrees and sunny", [{"type": "text", "text": "18 degrees and sunny"}]):
        # the tool's result as a string or as a list of parts: vLLM's parser takes both
        messages = ASK_WEATHER + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                                  {"role": "tool", "tool_call_id": call.id, "content": result}]
        second = completion(standin, messages=messages, tools=[TIMESTAMP, WEATHER])
        assert second.choices[0].finish_reason == "stop" and second.choices[0].message.content
        assert not second.choices[0].message.tool_calls


def test_small_talk_with_tools_on_offer_is_answered_in_text(standin):
    """Open WebUI offers its built-in tools with every chat: "hi" calls none of them."""
    reply = completion(standin, messages=[{"role": "user", "content": "hi"}], tools=[TIMESTAMP, WEATHER, NOTES])
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content
    assert not reply.choices[0].message.tool_calls


def test_arguments_follow_each_tools_schema(standin):
    ask = [{"role": "user", "content": "Use get_current_timestamp and search_notes for Friday"}]
    calls = completion(standin, messages=ask, tools=[TIMESTAMP, NOTES, WEATHER]).choices[0].message.tool_calls
    got = {c.function.name: json.loads(c.function.arguments) for c in calls}
    assert got == {"get_current_timestamp": {}, "search_notes": {"query": "Friday"}}  # named outright: both, in parallel
    assert len({c.id for c in calls}) == 2


def test_tool_choice_and_parallel_tool_calls_as_vllm_applies_them(standin):
    hi = [{"role": "user", "content": "hi"}]
    none = completion(standin, messages=ASK_WEATHER, tools=[WEATHER], tool_choice="none").choices[0]
    assert none.finish_reason == "stop" and none.message.content and not none.message.tool_calls
    required = completion(standin, messages=hi, tools=[WEATHER, TIMESTAMP], tool_choice="required").choices[0]
    assert required.finish_reason == "tool_calls" and required.message.content == ""  # forced: "" not null
    assert [c.function.name for c in required.message.tool_calls] == ["get_weather"]
    named = completion(standin, messages=hi, tools=[WEATHER, TIMESTAMP],
                       tool_choice={"type": "function", "function": {"name": "get_current_timestamp"}}).choices[0]
    assert named.finish_reason == "stop"  # OpenAI's for a forced named tool
    assert [(c.function.name, c.function.arguments) for c in named.message.tool_calls] == [("get_current_timestamp", "{}")]
    both = "Use get_current_timestamp and search_notes for Friday"
    one = completion(standin, messages=[{"role": "user", "content": both}], tools=[TIMESTAMP, NOTES],
                     parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["get_current_timestamp"]
    # forced calls come after a tool's result too, as vLLM forces them
    after = ASK_WEATHER + [{"role": "tool", "tool_call_id": "x", "content": "sunny"}]
    assert completion(standin, messages=after, tools=[WEATHER], tool_choice="required").choices[0].message.tool_calls


def test_auto_tool_choice_needs_the_servers_flags(standin):
    standin.auto_tools = False  # no --enable-auto-tool-choice / --tool-call-parser: calls are not extracted
    try:
        reply = completion(standin, messages=ASK_WEATHER, tools=[WEATHER]).choices[0]
    finally:
        standin.auto_tools = True
    assert reply.finish_reason == "stop" and not reply.message.tool_calls


@pytest.mark.parametrize("body, message, param", [
    ({"tools": []}, "`tools` must not be an empty array", "tools"),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "Invalid value for `tool_choice`: always!", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "Invalid value for `function`", "tool_choice.function"),
])
def test_bad_tools_get_vllms_400(standin, body, message, param):
    status, data = chat(standin, messages=ASK_WEATHER, **body)
    assert status == 400 and message in data["error"]["message"] and data["error"]["param"] == param, data
    assert data["error"]["type"] == "BadRequestError"


def test_tool_calls_stream_as_vllm_streams_them_and_the_sdk_puts_them_together(standin):
    status, chunks = chat(standin, messages=[{"role": "user", "content": "Use get_weather and search_notes in Oslo"}],
                          tools=[WEATHER, NOTES], stream=True, stream_options={"include_usage": True})
    assert status == 200
    parsed = [ChatCompletionChunk.model_validate(c) for c in chunks]
    deltas = [d for p in parsed for choice in p.choices for d in (choice.delta.tool_calls or [])]
    # each call's first delta: its index, id, type and name with the first arguments; then arguments alone
    firsts = [d for d in deltas if d.id]
    assert [(d.index, d.type, d.function.name) for d in firsts] == [(0, "function", "get_weather"),
                                                                    (1, "function", "search_notes")]
    assert all(d.function.name is None and d.id is None for d in deltas if not d.id)
    joined = {i: "".join(d.function.arguments for d in deltas if d.index == i) for i in (0, 1)}
    assert json.loads(joined[0]) == {"city": "Oslo", "unit": "celsius", "days": 1}
    assert json.loads(joined[1]) == {"query": "Oslo"}
    assert parsed[-2].choices[0].finish_reason == "tool_calls"
    assert parsed[-1].choices == [] and parsed[-1].usage.completion_tokens > 0  # include_usage: its own last chunk
    # the SDK's own accumulation of a stream gives the same calls
    from openai.lib.streaming.chat._completions import ChatCompletionStreamState
    state = ChatCompletionStreamState()
    for c in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(c))
    calls = state.get_final_completion().choices[0].message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
        [("get_weather", json.loads(joined[0])), ("search_notes", {"query": "Oslo"})]


def test_the_default_max_tokens_is_the_generation_configs_unless_overridden(standin, module):
    long = [{"role": "user", "content": "write a long story"}]
    lifted = completion(standin, messages=long)  # {"max_new_tokens": null} over the checkpoint's 256
    assert lifted.choices[0].finish_reason == "stop" and lifted.usage.completion_tokens == module.LONG_ANSWER_TOKENS
    saved = standin.sampling_defaults
    standin.sampling_defaults = module.vllm_chat.sampling_defaults({"max_new_tokens": 256}, {})  # no override
    try:
        cut = completion(standin, messages=long)
        asked = completion(standin, messages=long, max_tokens=1000)
    finally:
        standin.sampling_defaults = saved
    assert cut.choices[0].finish_reason == "length" and cut.usage.completion_tokens == 256  # seed 000's trap
    assert asked.choices[0].finish_reason == "stop" and asked.usage.completion_tokens == module.LONG_ANSWER_TOKENS


def test_sampling_defaults_are_vllms_get_diff_sampling_param(module):
    defaults = module.vllm_chat.sampling_defaults
    assert defaults({"max_new_tokens": 256, "do_sample": False}, {}) == {"max_tokens": 256}
    assert defaults({"max_new_tokens": 256}, {"max_new_tokens": None}) == {}
    assert defaults({"max_new_tokens": 256, "top_k": 64}, {"max_new_tokens": 2048, "temperature": 0.7, "top_p": 0.95}) \
        == {"max_tokens": 2048, "temperature": 0.7, "top_p": 0.95, "top_k": 64}
    assert defaults({"bos_token_id": 2}, {}) == {}
    max_tokens = module.vllm_chat.max_tokens
    assert max_tokens({}, 100, 8192, {}) == 8092  # no default: what the context leaves
    assert max_tokens({"max_tokens": 10, "max_completion_tokens": 20}, 100, 8192, {"max_tokens": 5}) == 20
    assert max_tokens({}, 100, 8192, {"max_tokens": 2048}) == 2048
    assert max_tokens({"max_tokens": 100000}, 100, 8192, {}) == 8092


def test_the_sdk_reads_the_answers(standin):
    """The official client, as users call it, against the stand-in itself."""
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{standin.server_address[1]}/v1", api_key=KEY, max_retries=0)
    call = client.chat.completions.create(model="diffusiongemma", messages=ASK_WEATHER, tools=[WEATHER])
    assert call.choices[0].message.tool_calls[0].function.name == "get_weather"
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="diffusiongemma", messages=ASK_WEATHER, tools=[])
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4o", messages=ASK_WEATHER)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=client.base_url, api_key="sk-wrong", max_retries=0).models.list()


def test_a_prompt_that_spells_out_its_json_gets_that_json_and_history_asks_for_nothing_long(standin):
    """Open WebUI's title prompt quotes the chat ("write a long story" and all) and asks for
    {"title": ...}: a model answers the short JSON, not a story."""
    prompt = ("### Task:\nGenerate a concise, 3-5 word title.\n### Output:\nJSON format: "
              '{ "title": "your concise title here" }\n### Chat History:\n<chat_history>\nUSER: write a long story\n'
              "</chat_history>")
    reply = completion(standin, messages=[{"role": "user", "content": prompt}])
    assert json.loads(reply.choices[0].message.content) == {"title": "your concise title here"}
    assert reply.choices[0].finish_reason == "stop"
    earlier = [{"role": "user", "content": "write a long story"}, {"role": "assistant", "content": "token"},
               {"role": "user", "content": "thanks"}]
    assert completion(standin, messages=earlier).usage.completion_tokens == 12  # what is asked now
