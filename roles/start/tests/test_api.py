"""When the service should run: it listens, answers and behaves as vLLM does."""
import json

import pytest


def test_service_running_as_declared(host, expected, fix):
    service = host.service(expected["unit"])
    if expected["state"] == "started":
        assert service.is_running, f"{expected['unit']} is not running (state: started); {fix}"
    else:
        assert not service.is_running, f"{expected['unit']} runs but state is stopped; {fix}"


@pytest.fixture
def running(host, expected):
    if expected["state"] != "started":
        pytest.skip("state: stopped")
    if not host.service(expected["unit"]).is_running:
        pytest.skip("the service is not running (see service_running_as_declared)")
    return expected


def test_vllm_listens_on_loopback_only(host, running, fix):
    port = running["vllm_port"]
    assert host.socket(f"tcp://127.0.0.1:{port}").is_listening, \
        f"nothing listens on 127.0.0.1:{port}: the service is {host.service(running['unit']).is_running and 'running' or 'not running'}; {fix}"
    assert not host.socket(f"tcp://0.0.0.0:{port}").is_listening, \
        f"vLLM listens on every interface at port {port}: only the front door may face the network; {fix}"


def test_health(api, running, fix):
    code, _ = api("/health", key=False)
    assert code == 200, f"/health answered {code}; {fix} (or see: journalctl -u {running['unit']})"


def test_models_lists_the_model_and_needs_the_key(api, running, fix):
    code, body = api("/v1/models")
    assert code == 200, f"/v1/models answered {code} with the key; {fix}"
    # the fleet's one name first (what responses carry), the variant's own name after it
    assert [m["id"] for m in json.loads(body)["data"]] == [running["served_model_name"], running["model"]], body[:300]
    code, _ = api("/v1/models", key=False)
    assert code == 401, f"/v1/models answered {code} without the API key: auth is off; {fix}"


def test_chat_completion_without_thinking(api, running, fix):
    code, body = api("/v1/chat/completions", {
        "model": running["model"], "temperature": 0, "max_tokens": 64,
        "messages": [{"role": "user", "content": "Say hi in one sentence."}],
        "chat_template_kwargs": {"enable_thinking": False}})
    assert code == 200, f"chat completion answered {code}: {body[:300]}"
    reply = json.loads(body)
    assert reply["choices"][0]["message"]["content"], "empty content"
    assert reply["usage"]["completion_tokens"] > 0 and reply["usage"]["prompt_tokens"] > 0


def test_tool_call_is_well_formed(api, running, fix):
    code, body = api("/v1/chat/completions", {
        "model": running["model"], "temperature": 0,
        "messages": [{"role": "user", "content": "What is the weather in Tokyo?"}],
        "chat_template_kwargs": {"enable_thinking": False},
        "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]})
    assert code == 200, f"tool request answered {code}: {body[:300]}"
    choice = json.loads(body)["choices"][0]
    assert choice["finish_reason"] == "tool_calls", f"finish_reason {choice['finish_reason']}: is " \
                                                    f"--enable-auto-tool-choice --tool-call-parser gemma4 set? {fix}"
    call = choice["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"]), dict)
    assert not choice["message"]["content"], "tool call leaked into content"
