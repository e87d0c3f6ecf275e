"""The lab's vLLM stand-in (lab/stubs/vllm) against vLLM 0.33.0's own code, at the chat
interface: every request below is one vLLM's ChatCompletionRequest accepts (its validators run
first), and the stand-in's answer, whole or streamed, is one vLLM's ChatCompletionResponse and
ChatCompletionStreamResponse accept; each request vLLM refuses for its tools, the stand-in
refuses with vLLM's own message and parameter. Run by checks/vllm/run.sh in .venv-vllm."""
import http.client
import importlib.machinery
import importlib.util
import json
import os
import sys
import threading

import vllm.platforms
from vllm.platforms.cpu import CpuPlatform

vllm.platforms._current_platform = CpuPlatform()  # no GPU here; the protocol needs none

from vllm.entrypoints.openai.chat_completion.protocol import (  # noqa: E402
    ChatCompletionRequest, ChatCompletionResponse, ChatCompletionStreamResponse)

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
STUBS = os.path.join(ROOT, "lab", "stubs")
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_current_timestamp", "parameters": {"type": "object"}}}
ASK = {"role": "user", "content": "What is the weather in Oslo?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [{"id": "chatcmpl-tool-1", "type": "function", "function": {
    "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "c"}'}}]}
# the tool-result turn in each shape vLLM's request model takes: text, parts, a name, no content
RESULTS = [{"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "4 degrees"},
           {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": [{"type": "text", "text": "4 degrees"}]},
           {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "name": "get_weather", "content": "4 degrees"},
           {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": ""}]


def standin():
    loader = importlib.machinery.SourceFileLoader("vllm_standin", os.path.join(STUBS, "vllm"))
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader("vllm_standin", loader))
    loader.exec_module(module)
    server = module.EventLoopServer(("127.0.0.1", 0), module.Handler)
    server.api_key, server.model, server.served_name = None, "google/diffusiongemma-26B-A4B-it", "diffusiongemma"
    server.served_names, server.steps, server.autoregressive = ["diffusiongemma"], 48, False
    server.routes = module.read_routes(os.path.join(STUBS, "vllm-routes.txt"))
    server.started, server.max_model_len, server.canvas, server.pass_seconds = 0, 8192, 256, 0.0
    server.force_include_usage, server.auto_tools = True, True
    server.sampling_defaults = module.vllm_chat.sampling_defaults({"max_new_tokens": 256}, {"max_new_tokens": None})
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def post(server, body):
    conn = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=10)
    conn.request("POST", "/v1/chat/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    return response.status, response.read().decode()


def main() -> int:
    server = standin()
    requests = [{"messages": [ASK], "tools": [WEATHER, CLOCK]},
                {"messages": [ASK], "tools": [WEATHER], "tool_choice": "none"},
                {"messages": [ASK], "tools": [WEATHER, CLOCK], "tool_choice": "required"},
                {"messages": [ASK], "tools": [WEATHER, CLOCK],
                 "tool_choice": {"type": "function", "function": {"name": "get_current_timestamp"}}},
                {"messages": [{"role": "user", "content": "use get_weather and get_current_timestamp"}],
                 "tools": [WEATHER, CLOCK], "parallel_tool_calls": False}]
    requests += [{"messages": [ASK, CALL, result], "tools": [WEATHER]} for result in RESULTS]
    failures, checked = [], 0
    for body in requests:
        for stream in (False, True):
            request = {"model": "diffusiongemma", **body, "stream": stream,
                       **({"stream_options": {"include_usage": True}} if stream else {})}
            ChatCompletionRequest.model_validate(request)  # vLLM takes it
            status, text = post(server, request)
            if status != 200:
                failures.append(f"{status} for a request vLLM takes: {request}: {text[:200]}")
                continue
            try:
                if stream:
                    for line in text.splitlines():
                        if line.startswith("data: {"):
                            ChatCompletionStreamResponse.model_validate_json(line[6:])
                else:
                    ChatCompletionResponse.model_validate_json(text)
            except Exception as exc:  # noqa: BLE001 - reported with the request
                failures.append(f"vLLM's response model refuses the answer to {request}: {exc}")
            if body["messages"][-1]["role"] == "tool" and not stream and json.loads(text)["choices"][0]["finish_reason"] != "stop":
                failures.append(f"no text answer after the tool's result: {text[:200]}")
            checked += 1
    refused = [{"tools": []}, {"tool_choice": "auto"}, {"tools": [WEATHER], "tool_choice": "sometimes"},
               {"tools": [WEATHER], "tool_choice": {"type": "function"}},
               {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {}}},
               {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": ""}}},
               {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}]
    for body in refused:
        request = {"model": "diffusiongemma", "messages": [ASK], **body}
        try:
            ChatCompletionRequest.model_validate(request)
            failures.append(f"vLLM takes {body}: not a refusal to check")
            continue
        except Exception as exc:  # noqa: BLE001 - vLLM's own validation error
            expected, param = getattr(exc, "args", [""])[0], getattr(exc, "parameter", None)
            expected = str(expected).split(" (parameter=")[0]
        status, text = post(server, request)
        got = json.loads(text).get("error", {}) if status == 400 else {}
        if status != 400 or got.get("message") != expected or (param and got.get("param") != param):
            failures.append(f"{body}: vLLM says 400 {expected!r} ({param}), the stand-in {status} {got}")
        checked += 1
    server.shutdown()
    for failure in failures:
        print("MISMATCH", failure)
    print(f"{checked - len(failures)} of {checked} exchanges as vLLM 0.33.0's protocol has them")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
