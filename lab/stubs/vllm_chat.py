"""What the vLLM stand-in (lab/stubs/vllm) decides about a chat request, as vLLM 0.33.0 and a
model behind it would: the request's tools checked as vLLM's ChatCompletionRequest checks them,
the tool calls a model makes (or none), their arguments made from each tool's JSON schema, and
the sampling defaults vLLM takes from the checkpoint's generation_config.json and
--override-generation-config. Pure functions: the stand-in sends what they return.

Read in the wheel: entrypoints/openai/chat_completion/protocol.py (check_tool_usage),
message_assembly.py (keeps_tool_calls, content "" when calls are forced),
serve/utils/tool_calls_utils.py (parallel_tool_calls=false keeps the first call; finish_reason
"tool_calls" unless a named tool was forced: "stop"), renderers/chat_utils/tool_call.py (ids),
config/model.py (get_diff_sampling_param), serve/utils/api_utils.py (get_max_tokens)."""
from __future__ import annotations

import json
import re
import uuid

NAMED_USAGE = 'Correct usage: `{"type": "function", "function": {"name": "my_function"}}`'
# the sampling defaults vLLM reads from a generation config (config/model.py available_params)
SAMPLING_PARAMS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                   "min_p", "max_new_tokens", "skip_special_tokens")
# words of a tool's name too common to say that a message asks for that tool
COMMON_WORDS = {"get", "set", "current", "query", "fetch", "list", "view", "tool", "data", "info", "with", "from",
                "into", "make", "find", "read", "write", "update", "delete", "add", "create", "the"}


def tool_error(req: dict) -> tuple[str, str | None] | None:
    """(message, param) of the 400 vLLM answers for the request's tools, or None."""
    tools, choice = req.get("tools"), req.get("tool_choice")
    if tools == []:
        return ("`tools` must not be an empty array. Either provide at least one tool or omit the field entirely.",
                "tools")
    if choice is None or choice == "none":
        return None
    if tools is None:
        return "When using `tool_choice`, `tools` must be set.", "tool_choice"
    if choice not in ("auto", "required") and not isinstance(choice, dict):
        return (f"Invalid value for `tool_choice`: {choice}! Only named tools, \"none\", \"auto\" or \"required\" "
                f"are supported.", "tool_choice")
    if isinstance(choice, dict):
        function = choice.get("function")
        if not isinstance(function, dict):
            return f"Invalid value for `function`: `{function}` in `tool_choice`! {NAMED_USAGE}", "tool_choice.function"
        if "name" not in function:
            return f"Expected field `name` in `function` in `tool_choice`! {NAMED_USAGE}", "tool_choice.function.name"
        name = function["name"]
        if not isinstance(name, str) or not name:
            return f"Invalid `name` in `function`: `{name}` in `tool_choice`! {NAMED_USAGE}", "tool_choice.function.name"
        if name not in [(t.get("function") or {}).get("name") for t in tools]:
            return "The tool specified in `tool_choice` does not match any of the specified `tools`", "tool_choice"
    return None


def json_answer(text: str) -> str | None:
    """What a model answers to a prompt that spells out the JSON it wants ("JSON format: {...}",
    as Open WebUI's title, tags and follow-up prompts do): that JSON, or None."""
    at = text.find("JSON format:")
    start = text.find("{", at) if at >= 0 else -1
    if start < 0:
        return None
    depth = 0
    for end in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[end], 0)
        if depth == 0:
            try:
                return json.dumps(json.loads(text[start:end + 1]))
            except ValueError:
                return None
    return None


def last_user_text(req: dict) -> str:
    users = [m for m in req.get("messages") or [] if isinstance(m, dict) and m.get("role", "user") == "user"]
    return text_of(users[-1].get("content")) if users else ""


def text_of(content) -> str:
    """A message's text: a string, or OpenAI's list of parts (their text parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def name_words(name: str) -> set[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1 \2", name)
    return {w for w in re.split(r"[^A-Za-z0-9]+", spaced.lower()) if len(w) >= 4 and w not in COMMON_WORDS}


def asked_for(tools: list[dict], text: str) -> list[dict]:
    """The tools a user's message asks for, as a model reads it: those it names outright, else
    those a word of whose name it uses ("weather" for get_weather); none for small talk."""
    lowered = text.lower()
    named = [t for t in tools if (t.get("function") or {}).get("name", "").lower() in lowered]
    if named:
        return named
    words = set(re.findall(r"[a-z0-9]+", lowered))
    return [t for t in tools if name_words((t.get("function") or {}).get("name", "")) & words]


def tool_calls(req: dict, auto_tools: bool) -> tuple[list[tuple[str, str]], bool]:
    """(the calls as (name, arguments JSON), forced): what the model calls for this request.

    - tool_choice "none" or no tools: no calls;
    - a named function: that one, always (vLLM forces it); "required": the tools the last
      user message asks for, else the first tool, always;
    - "auto" (the default with tools; only with --enable-auto-tool-choice and a parser): the
      tools the last user message asks for, unless the conversation already ends with their
      results (a `tool` message): then the model answers in text, as a model does;
    - parallel_tool_calls false: the first call alone."""
    tools = [t for t in req.get("tools") or [] if isinstance(t, dict)]
    choice = req.get("tool_choice", "auto" if tools else None)
    if not tools or choice in (None, "none"):
        return [], False
    messages = [m for m in req.get("messages") or [] if isinstance(m, dict)]
    user = next((text_of(m.get("content")) for m in reversed(messages) if m.get("role") == "user"), "")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        chosen, forced = [t for t in tools if (t.get("function") or {}).get("name") == name][:1], True
    elif choice == "required":
        chosen, forced = asked_for(tools, user) or tools[:1], True
    else:
        if not auto_tools or (messages and messages[-1].get("role") == "tool"):
            return [], False
        chosen, forced = asked_for(tools, user), False
    if req.get("parallel_tool_calls") is False:
        chosen = chosen[:1]
    words = re.findall(r"[A-Za-z][A-Za-z0-9'-]*", user)
    calls = [(t["function"]["name"], json.dumps(arguments(t["function"].get("parameters") or {}, words)))
             for t in chosen]
    return calls, forced


def finish_reason(calls: list, req: dict, engine_finish: str) -> str:
    """serve/utils/tool_calls_utils.py resolve_finish_reason."""
    named = isinstance(req.get("tool_choice"), dict)
    return "tool_calls" if calls and engine_finish == "stop" and not named else engine_finish


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


def arguments(schema: dict, words: list[str]):
    """A value that the JSON schema accepts: an object's required properties (none: {}), an
    enum's first value, a const, a default, a string from the user's words (the last capitalised
    one: "Tokyo" in "weather in Tokyo?"), numbers within their bounds, arrays of minItems."""
    if not isinstance(schema, dict):
        return {}
    for key in ("const", "default"):
        if key in schema:
            return schema[key]
    if schema.get("enum"):
        return schema["enum"][0]
    for key in ("anyOf", "oneOf", "allOf"):
        if schema.get(key):
            return arguments(schema[key][0], words)
    kind = schema.get("type", "object" if "properties" in schema else "string")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object":
        properties = schema.get("properties") or {}
        return {name: arguments(properties.get(name, {}), words) for name in schema.get("required") or []
                if name in properties or not properties}
    if kind == "array":
        return [arguments(schema.get("items") or {}, words) for _ in range(int(schema.get("minItems") or 0))]
    if kind in ("integer", "number"):
        low = schema["minimum"] if "minimum" in schema else schema["exclusiveMinimum"] + 1 \
            if "exclusiveMinimum" in schema else min(1, schema.get("maximum", 1))
        return int(low) if kind == "integer" else float(low)
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    capitalised = [w for w in words if w[:1].isupper()][1:] or words[-1:] or ["lab"]
    text = capitalised[-1]
    minimum = int(schema.get("minLength") or 0)
    return (text * (minimum // max(len(text), 1) + 1))[:max(minimum, len(text))][:int(schema.get("maxLength") or 10**6)]


def sampling_defaults(generation_config: dict, override: dict) -> dict:
    """config/model.py get_diff_sampling_param: the checkpoint's generation config with the
    override over it; a null drops the key (so {"max_new_tokens": null} lifts the 256 cap);
    max_new_tokens becomes max_tokens."""
    config = {**generation_config, **override}
    if not any(p in config for p in SAMPLING_PARAMS):
        return {}
    out = {p: config[p] for p in SAMPLING_PARAMS if config.get(p) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    return out


def max_tokens(req: dict, prompt_tokens: int, max_model_len: int, defaults: dict) -> int:
    """serve/utils/api_utils.py get_max_tokens: the request's (max_completion_tokens first), else
    the default, within what the context leaves."""
    asked = req.get("max_completion_tokens")
    if asked is None:
        asked = req.get("max_tokens")
    if asked is None:
        asked = req.get("max_output_tokens")
    if asked is None:
        asked = defaults.get("max_tokens")
    room = max(max_model_len - prompt_tokens, 1)
    return min(int(asked), room) if asked is not None else room
