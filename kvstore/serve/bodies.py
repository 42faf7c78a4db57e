"""Which POST bodies `kvstore serve` refuses (400) before mlx_lm.server sees them, and why.

mlx_lm.server 0.32 parses a body and then trusts it: a field of the wrong shape either kills its
generation loop (a `prompt` that is a list, a `stop` of numbers), fails where it answers 404 with
a bare Python message (a message without a `role` answers `"'role'"`), or fails after the answer
has begun (a `stream_options` without `include_usage`, a `seed` past 64 bits), which ends the
connection with a traceback in the log and a cut answer. Each of those is named here instead, by
its field, never by its value: a body is the user's prompt.
"""

from __future__ import annotations

import json
from typing import Any

INVALID_JSON = "Invalid JSON in request body"
INVALID_BODY = "Invalid request body"
#: Paths whose body carries chat `messages` (the generation and render paths, and a prefetch).
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/chat/completions/render", "/kvstore/prefetch")
#: Content part types mlx_lm.server takes: text, and images (for a vision model).
IMAGE_PARTS = ("image_url", "input_image", "image")
MAX_SEED = 2**64 - 1  # (mlx.random.seed takes an unsigned 64-bit integer)
#: apply_chat_template's own arguments, which mlx_lm.server lets `chat_template_kwargs` override:
#: `padding`/`max_length` pad the prompt past the context check (minutes of prefill, every other
#: request waiting), `return_tensors` kills the generation loop, `chat_template` runs the client's
#: own template; the rest fail as a 404 with a bare Python message. Template variables stay allowed.
RESERVED_TEMPLATE_KWARGS = ("add_generation_prompt", "chat_template", "continue_final_message", "conversation",
                            "documents", "max_length", "messages", "padding", "return_assistant_tokens_mask",
                            "return_dict", "return_tensors", "tokenize", "tokenizer_kwargs", "tools", "truncation")
#: Fields mlx_lm.server reads as names (of a model, an adapter): a string or absent.
NAME_FIELDS = ("model", "draft_model", "adapters")


def body_problem(path: str, raw: bytes) -> tuple[str, str] | None:
    """`(why, error)` if mlx_lm.server cannot serve this POST body, else None."""
    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=_not_json)
    except UnicodeDecodeError as e:
        return f"it is not UTF-8 (byte {e.start})", INVALID_JSON
    except json.JSONDecodeError as e:
        return f"{e.msg} (line {e.lineno}, column {e.colno})", INVALID_JSON
    except ValueError as e:  # NaN, Infinity (`_not_json`)
        return str(e), INVALID_JSON
    except RecursionError:
        return "it is nested too deeply", INVALID_JSON
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (\ud800): no tokenizer takes it
        return "it holds text that is not Unicode (a lone surrogate)", INVALID_JSON
    if not isinstance(body, dict):
        return f"it is a JSON {json_type(body)}, not an object", INVALID_JSON
    wrong = _fatal_field(path, body) or _misshapen_field(path, body)
    return (wrong, INVALID_BODY) if wrong else None


def _not_json(name: str):
    raise ValueError(f"{name} is no JSON number")


def _fatal_field(path: str, body: dict) -> str | None:
    """What is wrong with a field that mlx_lm.server 0.32 would hand unchecked to its generation
    thread, which then dies and fails every later request ("generation thread died")."""
    if path == "/v1/completions" and "prompt" in body and not isinstance(body["prompt"], str):
        return f"its prompt is a JSON {json_type(body['prompt'])}, not a string"  # tokenized as a batch
    if path == "/v1/completions" and body.get("prompt") == "":
        return "its prompt is empty"
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, str) and not (
            isinstance(stop, list) and all(isinstance(s, str) for s in stop)):
        return "its stop is not a string or a list of strings"
    return None


def _misshapen_field(path: str, body: dict) -> str | None:
    """What is wrong with a field mlx_lm.server fails on with a bare Python message (answered as
    404), or after its answer began (a cut answer and a traceback in the log)."""
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        return f"its stream_options is a JSON {json_type(options)}, not an object"
    if isinstance(options, dict) and not isinstance(options.get("include_usage", False), bool):
        return "its stream_options.include_usage is not true or false"
    for name in ("max_tokens", "max_completion_tokens"):  # (true is 1 in Python; mlx_lm names only max_tokens)
        value = body.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            return f"its {name} is a JSON {json_type(value)}, not an integer"
    for name in NAME_FIELDS:  # (stock: "requested_model must be of type str", or a 404 for a draft model)
        if body.get(name) is not None and not isinstance(body[name], str):
            return f"its {name} is a JSON {json_type(body[name])}, not a string"
    seed = body.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and not 0 <= seed <= MAX_SEED:
        return f"its seed is not an integer from 0 to {MAX_SEED}"
    for name in ("chat_template_kwargs", "role_mapping"):
        if body.get(name) is not None and not isinstance(body[name], dict):
            return f"its {name} is a JSON {json_type(body[name])}, not an object"
    reserved = [k for k in RESERVED_TEMPLATE_KWARGS if k in (body.get("chat_template_kwargs") or {})]
    if reserved:
        return (f"its chat_template_kwargs sets {reserved[0]}, an argument of the server's own call to the chat "
                "template, not a variable of the template")
    bias = body.get("logit_bias")  # (stock: a null or a list as a bias fails with a 500)
    for key, value in bias.items() if isinstance(bias, dict) else ():
        if isinstance(value, (list, dict)) or value is None:
            return f"its logit_bias[{json.dumps(key)[:24]}] is a JSON {json_type(value)}, not a number"
    tools = body.get("tools")
    if tools and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        return "its tools is not a list of objects"
    if path in CHAT_PATHS and "messages" in body:
        return _messages_problem(body["messages"])
    return None


def _messages_problem(messages: Any) -> str | None:
    """What is wrong with chat `messages`: a non-empty list of objects, each with a `role` (text)
    and a `content` that is text, null or a list of text and image parts."""
    if not isinstance(messages, list):
        return f"its messages is a JSON {json_type(messages)}, not a list of {{role, content}} objects"
    if not messages:
        return "its messages is empty: a chat needs at least one message"
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            return f"its {where} is a JSON {json_type(message)}, not an object with role and content"
        role = message.get("role")
        if not isinstance(role, str) or not role:
            return f"its {where}.role is {'missing' if role is None else 'not a non-empty string'}"
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            return f"its {where}.content is a JSON {json_type(content)}, not text or a list of parts"
        for j, part in enumerate(content if isinstance(content, list) else ()):
            at = f"{where}.content[{j}]"
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and not isinstance(part.get("text"), str):
                return f"its {at} is a text part without a string text"
            if kind != "text" and kind not in IMAGE_PARTS:
                return f"its {at} is not a text or image part (an object whose type is text or image_url)"
            url = part.get("image_url", part.get("image")) if kind in IMAGE_PARTS else ""
            if not isinstance(url.get("url") if isinstance(url, dict) else url, str):
                return f"its {at} is an image part without a string url"
        problem = _tool_calls_problem(message.get("tool_calls"), f"{where}.tool_calls")
        if problem:
            return problem
    return None


def _tool_calls_problem(calls: Any, where: str) -> str | None:
    """What is wrong with a message's `tool_calls` (stock: a 404 with a bare Python message): a
    list of objects, each `function` an object whose `arguments`, when text, are JSON."""
    if not calls:
        return None
    if not isinstance(calls, list):
        return f"its {where} is a JSON {json_type(calls)}, not a list of objects"
    for i, call in enumerate(calls):
        if not isinstance(call, dict):
            return f"its {where}[{i}] is a JSON {json_type(call)}, not an object"
        function = call.get("function")
        if function and not isinstance(function, dict):
            return f"its {where}[{i}].function is a JSON {json_type(function)}, not an object"
        arguments = function.get("arguments") if function else None
        if isinstance(arguments, str) and arguments:
            try:
                json.loads(arguments)
            except ValueError:
                return f"its {where}[{i}].function.arguments is not JSON text"
    return None


def json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
