"""When the service should run: every replica listens, answers and behaves as vLLM does."""
import json

import pytest


def test_service_running_as_declared(host, expected, fix):
    for replica in expected["replicas"]:
        service = host.service(replica["unit"])
        if expected["state"] == "started":
            assert service.is_running, f"{replica['unit']} is not running (state: started); {fix}"
        else:
            assert not service.is_running, f"{replica['unit']} runs but state is stopped; {fix}"


@pytest.fixture
def running(host, expected):
    """The replicas that run (each check below goes through every one of them)."""
    if expected["state"] != "started":
        pytest.skip("state: stopped")
    replicas = [r for r in expected["replicas"] if host.service(r["unit"]).is_running]
    if not replicas:
        pytest.skip("no replica is running (see service_running_as_declared)")
    return replicas


def test_vllm_listens_on_loopback_only(host, running, fix):
    for replica in running:
        port = replica["vllm_port"]
        assert host.socket(f"tcp://127.0.0.1:{port}").is_listening, \
            f"{replica['unit']}: nothing listens on 127.0.0.1:{port}; {fix}"
        assert not host.socket(f"tcp://0.0.0.0:{port}").is_listening, \
            f"{replica['unit']}: vLLM listens on every interface at port {port}: only the front door may face " \
            f"the network; {fix}"


def test_health(api, running, fix):
    for replica in running:
        code, _ = api("/health", key=False, port=replica["vllm_port"])
        assert code == 200, f"{replica['unit']}: /health answered {code}; {fix} (or see: journalctl -u {replica['unit']})"


def test_models_lists_the_model_and_needs_the_key(api, expected, running, fix):
    for replica in running:
        code, body = api("/v1/models", port=replica["vllm_port"])
        assert code == 200, f"{replica['unit']}: /v1/models answered {code} with the key; {fix}"
        # its family's one name first (what responses carry), the variant's own name after it, then
        # the names of the families that fall back to it
        names = [replica["served_name"], replica["model"], *replica["served_names"][1:]]
        assert [m["id"] for m in json.loads(body)["data"]] == names, \
            f"{replica['unit']}: {body[:300]}"
        code, _ = api("/v1/models", key=False, port=replica["vllm_port"])
        assert code == 401, f"{replica['unit']}: /v1/models answered {code} without the API key: auth is off; {fix}"


def test_chat_completion_without_thinking(api, running, fix):
    for replica in running:
        code, body = api("/v1/chat/completions", {
            "model": replica["model"], "temperature": 0, "max_tokens": 64,
            "messages": [{"role": "user", "content": "Say hi in one sentence."}],
            "chat_template_kwargs": {"enable_thinking": False}}, port=replica["vllm_port"])
        assert code == 200, f"{replica['unit']}: chat completion answered {code}: {body[:300]}"
        reply = json.loads(body)
        assert reply["choices"][0]["message"]["content"], f"{replica['unit']}: empty content"
        assert reply["usage"]["completion_tokens"] > 0 and reply["usage"]["prompt_tokens"] > 0


def test_tool_call_is_well_formed(api, running, fix):
    for replica in running:
        code, body = api("/v1/chat/completions", {
            "model": replica["model"], "temperature": 0,
            "messages": [{"role": "user", "content": "What is the weather in Tokyo?"}],
            "chat_template_kwargs": {"enable_thinking": False},
            "tools": [{"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]},
            port=replica["vllm_port"])
        assert code == 200, f"{replica['unit']}: tool request answered {code}: {body[:300]}"
        choice = json.loads(body)["choices"][0]
        assert choice["finish_reason"] == "tool_calls", \
            f"{replica['unit']}: finish_reason {choice['finish_reason']}: is --enable-auto-tool-choice " \
            f"--tool-call-parser gemma4 set? {fix}"
        call = choice["message"]["tool_calls"][0]["function"]
        assert call["name"] == "get_weather" and isinstance(json.loads(call["arguments"]), dict)
        assert not choice["message"]["content"], f"{replica['unit']}: tool call leaked into content"


def test_each_replica_sees_only_its_gpus(host, running, expected, fix):
    """nvidia-smi inside each replica's container lists exactly the GPUs it was handed."""
    for replica in running:
        if not replica["gpus"]:
            continue
        out = host.run(f"{expected['runtime']} exec {replica['container']} nvidia-smi -L")
        seen = [line.rsplit("UUID: ", 1)[1].rstrip(")") for line in out.stdout.splitlines() if "UUID: " in line]
        assert seen == replica["gpus"], \
            f"{replica['unit']} sees GPUs {seen or out.stderr.strip()[:200]}, was handed {replica['gpus']}; {fix}"
