"""Prompt files for `kvstore warm` and `kvstore generate`: one JSON object per line.

    {"prompt": "text"}                                   the text, tokenized as mlx-lm does
    {"messages": [{"role": "user", "content": "..."}]}   the chat template, with the generation prompt
                                                         (content as mlx_lm.server reads it: text parts
                                                         joined, null as "")
    {"tokens": [1, 2, 3]}                                token ids, used as they are
    optional: "id": "name", "pin": true                  (pinned prompts are never evicted by gc;
                                                          "pin": false unpins a pinned one)

A messages line's leading system messages are stored as a "system" prompt, which a disk budget
evicts last (`cache_types`).

Parsing never stops at a bad line: each one becomes a `LineError` naming the file, line and field,
and the good lines around it are still returned. A field kvstore does not know is an error too (a
typo of "pin" would otherwise leave the prompt unpinned), with the known field it resembles.

Bounded before anything expensive: a line longer than `MAX_LINE_BYTES` is refused before it is
decoded, and a text longer than `MAX_CHARS_PER_TOKEN` characters per token of the model's context
before it is tokenized (no tokenizer averages that many: such a text cannot fit the context).
"""

from __future__ import annotations

import difflib
import errno
import io
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Sequence, Union

import numpy as np

KINDS = ("prompt", "messages", "tokens")
FIELDS = (*KINDS, "id", "pin")
MAX_LINE_BYTES = 32 << 20  # 32 MiB: a million-token prompt is a few MB of text
MAX_CHARS_PER_TOKEN = 32


@dataclass(frozen=True)
class PromptLine:
    """One valid line: what to tokenize (`kind`, `value`) and where it came from."""

    source: str
    line: int | None
    kind: str  # one of KINDS
    value: Any  # str, list of message dicts, or list of ints
    id: str | None = None
    pin: bool | None = None  # None: the line says nothing of pins (a pinned prompt stays pinned)

    @property
    def where(self) -> str:
        here = self.source if self.line is None else f"{self.source}:{self.line}"
        return f"{here} (id {self.id})" if self.id not in (None, "") else here  # (an empty id names nothing)


@dataclass(frozen=True)
class LineError:
    """What is wrong with one line, and where."""

    source: str
    line: int | None  # None when the input was not a file (a command-line argument)
    field: str | None
    message: str

    def __str__(self) -> str:
        name = self.source.lstrip("-")  # (a command-line option names its field: `--messages[1].role`)
        if self.line is None and self.field and self.field.startswith(name) and self.field[len(name):][:1] in "[.":
            return f"{self.source}{self.field[len(name):]}: {self.message}"
        where = self.source if self.line is None else f"{self.source}:{self.line}"
        field = f" {self.field}:" if self.field else ""
        return f"{where}:{field} {self.message}"


Parsed = Union[PromptLine, LineError]


def read(path: str | Path) -> Iterator[Parsed]:
    """Parse the prompt file at `path` (`-` is standard input), a line at a time: memory is
    bounded by the longest line kept (`MAX_LINE_BYTES`). OSError if it cannot be read."""
    if str(path) == "-":
        if sys.stdin is None:  # (started with standard input closed: `<&-`)
            raise OSError(errno.EBADF, "standard input is closed")
        return parse_stream(sys.stdin.buffer, "<stdin>")
    p = Path(path)
    if p.is_dir():
        raise IsADirectoryError(21, "is a directory, not a JSONL file", str(p))
    f = p.open("rb")

    def lines() -> Iterator[Parsed]:
        with f:
            yield from parse_stream(f, str(path))
    return lines()


def parse(data: bytes | str, source: str = "<input>") -> Iterator[Parsed]:
    """Parse JSONL `data`; blank lines are skipped, every other line gives one result."""
    if isinstance(data, str):
        data = data.encode("utf-8")
    return parse_stream(io.BytesIO(data), source)


def _lines(f: BinaryIO) -> Iterator[tuple[int, int, bytes | None]]:
    """(line number, length without the newline, the line or None when it is over the limit).
    A line over the limit is skipped through in blocks, never held whole."""
    number = 0
    while True:
        raw = f.readline(MAX_LINE_BYTES + 2)  # room for "\r\n"
        if not raw:
            return
        number += 1
        if raw.endswith(b"\n") or len(raw) <= MAX_LINE_BYTES:
            line = raw[:-1] if raw.endswith(b"\n") else raw
            yield number, len(line), (line if len(line) <= MAX_LINE_BYTES else None)
            continue
        size = len(raw)
        while raw and not raw.endswith(b"\n"):
            raw = f.readline(1 << 20)
            size += len(raw)
        yield number, size - raw.endswith(b"\n"), None


def parse_stream(f: BinaryIO, source: str) -> Iterator[Parsed]:
    """Parse the JSONL lines read from the binary stream `f`."""
    for number, size, raw in _lines(f):
        if raw is None:  # refused before decoding or parsing it
            yield LineError(source, number, None, f"line of {size:,} bytes is longer than the limit "
                                                  f"of {MAX_LINE_BYTES:,} bytes ({MAX_LINE_BYTES >> 20} MiB)")
            continue
        if not raw.strip():
            continue
        if number == 1 and raw[:2] in (b"\xff\xfe", b"\xfe\xff"):  # (every line of it would be garbled)
            yield LineError(source, number, None, "the file is UTF-16 text (it starts with a UTF-16 byte order mark, "
                                                  "as Windows tools write): save it as UTF-8")
            return
        try:
            text = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # (a BOM, as some editors write)
        except UnicodeDecodeError as e:
            yield LineError(source, number, None, f"not UTF-8 text (bad byte at column {e.start + 1})")
            continue
        try:
            obj = loads(text)
        except ValueError as e:  # (json.JSONDecodeError is one)
            lone_cr = "\r" in text.rstrip("\r") and "Extra data" in str(e)
            yield LineError(source, number, None, str(e) + (
                ": its lines end in a lone CR (old Mac line endings); save the file with LF or CRLF line endings"
                if lone_cr else ""))
            continue
        except RecursionError:  # json.loads recurses once per level of [ or {
            yield LineError(source, number, None, "JSON nested too deeply")
            continue
        yield parse_object(obj, source, number)


def loads(text: str) -> Any:
    """One JSON value; a ValueError saying what is wrong, as `not valid JSON (...)`. A field
    given twice in one object is refused: JSON would keep the last one silently (of
    `"pin": true, ..., "pin": false`, the unpin)."""
    try:
        return json.loads(text, object_pairs_hook=_no_twice)
    except json.JSONDecodeError as e:
        # (some of json's messages end in "at": "Invalid control character at")
        raise ValueError(f"not valid JSON ({e.msg.removesuffix(' at')} at column {e.colno})") from None


def _no_twice(pairs: list[tuple[str, Any]]) -> dict:
    out = dict(pairs)
    if len(out) < len(pairs):
        names = [k for k, _ in pairs]
        twice = next(k for k in names if names.count(k) > 1)
        raise ValueError(f"the field {_quoted(twice)} is given twice in one object (JSON would keep the last one): give it once")
    return out


def parse_object(obj: Any, source: str, line: int | None) -> Parsed:
    """Validate one decoded JSON value as a prompt line."""
    def bad(field: str | None, message: str) -> LineError:
        return LineError(source, line, field, message)

    if not isinstance(obj, dict):
        hint = (" (a JSON array: a prompt file holds one object per line, JSONL, with no [ ] around them)"
                if isinstance(obj, list) and obj and all(isinstance(o, dict) for o in obj) else "")
        return bad(None, f"expected a JSON object with one of {_kinds()}, got {_json_type(obj)}{hint}")
    unknown = [k for k in obj if k not in FIELDS]
    present = [k for k in KINDS if k in obj]
    if not present:
        hint = f"; {_unknown_field(unknown[0])}" if unknown else ""
        return bad(None, f"none of the fields {_kinds()} is present{hint}")
    if unknown:
        return bad(None, _unknown_field(unknown[0]))
    if len(present) > 1:
        return bad(present[1], f"give only one of {_kinds()}; this line has {' and '.join(present)}")
    kind = present[0]
    value = obj[kind]
    error = {"prompt": check_prompt, "messages": check_messages, "tokens": check_tokens}[kind](value) \
        or _lone_surrogate(value, kind)
    if error is not None:
        field, message = error
        return bad(field, message)
    if kind == "messages":
        value = as_server_reads(value)

    ident = obj.get("id")
    if ident is not None:
        if isinstance(ident, bool) or not isinstance(ident, (str, int)):
            return bad("id", f"must be a string or an integer, got {_json_type(ident)}")
        ident = str(ident)
    pin = obj.get("pin")
    if pin is not None and not isinstance(pin, bool):
        return bad("pin", f"must be true or false, got {_json_type(pin)}")
    return PromptLine(source, line, kind, value, ident, pin)


def _lone_surrogate(value: Any, field: str) -> tuple[str, str] | None:
    """(field, message) for the first string in `value` holding half of a UTF-16 pair
    (`"\\ud83d"` alone): JSON reads it, but it is no text, and no tokenizer encodes it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return field, (f"holds {value[e.start]!r}, half of a UTF-16 surrogate pair with no other half, at "
                           f"character {e.start + 1}: not text a tokenizer can encode")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            if (found := _lone_surrogate(v, f"{field}[{i}]")) is not None:
                return found
    elif isinstance(value, dict):
        for k, v in value.items():
            if (found := _lone_surrogate(v, f"{field}.{k}")) is not None:
                return found
    return None


def _unknown_field(name: str) -> str:
    close = difflib.get_close_matches(name, FIELDS, n=1, cutoff=0.6)
    if not close:
        close = difflib.get_close_matches(name.lower(), FIELDS, n=1, cutoff=0.6)
    hint = f"did you mean \"{close[0]}\"? " if close else ""
    return f"unknown field {_quoted(name)} ({hint}the fields are {', '.join(map(_quoted, FIELDS))})"


def _quoted(name: str) -> str:
    """A field name as JSON would write it: quoted, with control characters escaped."""
    return json.dumps(name)


def check_length(item: "PromptLine", context: int) -> tuple[str, str] | None:
    """(field, message) if the text of `item` is too long to tokenize for a model whose context
    is `context` tokens: checked before tokenizing, which costs time and memory per character."""
    if item.kind == "tokens":
        return None  # already a list of ids: its length is compared with the context as it is
    limit = context * MAX_CHARS_PER_TOKEN
    if item.kind == "prompt":
        n = len(item.value)
    else:
        n = sum(len(m["content"]) for m in item.value)  # (strings: `as_server_reads` joined any parts)
    if n > limit:
        return item.kind, (f"skipped: {n:,} characters is more than the {limit:,} that can fit the "
                           f"model's context ({context} tokens x {MAX_CHARS_PER_TOKEN} characters); "
                           f"not tokenized")
    return None


def check_prompt(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, str):
        return "prompt", f"must be a string, got {_json_type(value)}"
    if not value:
        return "prompt", "is empty"
    return None


def check_messages(value: Any) -> tuple[str, str] | None:
    if not isinstance(value, list):
        return "messages", f"must be a list of {{\"role\": ..., \"content\": ...}} objects, got {_json_type(value)}"
    if not value:
        return "messages", "is empty"
    for i, message in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            return where, f"must be an object with \"role\" and \"content\", got {_json_type(message)}"
        for key in ("role", "content"):
            if key not in message:
                close = difflib.get_close_matches(key, [k for k in message if isinstance(k, str)], n=1, cutoff=0.6)
                return f"{where}.{key}", "is missing" + (f" (there is {_quoted(close[0])}: a typo of {_quoted(key)}?)"
                                                         if close else "")
        if not isinstance(message["role"], str) or not message["role"]:
            return f"{where}.role", f"must be a non-empty string, got {json.dumps(message['role'])}"
        problem = _check_content(message["content"], f"{where}.content") or _check_tool_calls(message, where)
        if problem is not None:
            return problem
    return None


def _check_content(content: Any, where: str) -> tuple[str, str] | None:
    """A string, null, or a list of {"type": "text", "text": ...} parts: what `mlx_lm.server`
    reads (other parts, images, it cannot put in a text prompt)."""
    if content is None or isinstance(content, str):
        return None
    if not isinstance(content, list):
        return where, f"must be a string, or a list of {{\"type\": \"text\", \"text\": ...}} parts, got {_json_type(content)}"
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            kind = f"a part of type {_quoted(part['type'])}" if isinstance(part, dict) and isinstance(part.get("type"), str) \
                else _json_type(part)
            return f"{where}[{j}]", f"must be a {{\"type\": \"text\", \"text\": ...}} part, got {kind} (only text can be warmed)"
        if not isinstance(part.get("text"), str):
            return f"{where}[{j}].text", f"must be a string, got {_json_type(part.get('text'))}"
    return None


def _check_tool_calls(message: dict, where: str) -> tuple[str, str] | None:
    """`mlx_lm.server` decodes a tool call's "arguments" given as a JSON string: it must be JSON."""
    calls = message.get("tool_calls")
    if calls is not None and not isinstance(calls, list):
        return f"{where}.tool_calls", f"must be a list of tool calls, got {_json_type(calls)}"
    for j, call in enumerate(calls or ()):
        function = call.get("function") if isinstance(call, dict) else None
        arguments = function.get("arguments") if isinstance(function, dict) else None
        if isinstance(arguments, str) and arguments:
            try:
                json.loads(arguments)
            except ValueError as e:
                return f"{where}.tool_calls[{j}].function.arguments", f"not valid JSON ({e})"
    return None


def as_server_reads(messages: list[dict]) -> list[dict]:
    """`messages` as `mlx_lm.server` hands them to the chat template (its `process_message_content`):
    a list of text parts joined into one string, a null content as "", a tool call's arguments
    decoded from their JSON string. Otherwise the template renders the list or None as it is, and
    the warmed tokens would not be the server's."""
    out = []
    for message in messages:
        message = dict(message)
        content = message["content"]
        if isinstance(content, list):
            message["content"] = "".join(part["text"] for part in content)
        elif content is None:
            message["content"] = ""
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_decoded_arguments(call) for call in message["tool_calls"]]
        out.append(message)
    return out


def _decoded_arguments(call: Any) -> Any:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not (isinstance(arguments, str) and arguments):
        return call
    return {**call, "function": {**function, "arguments": json.loads(arguments)}}


def check_tokens(value: Any, vocab_size: int | None = None) -> tuple[str, str] | None:
    if not isinstance(value, list):
        return "tokens", f"must be a list of token ids, got {_json_type(value)}"
    if not value:
        return "tokens", "is empty"
    for i, t in enumerate(value):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0:
            return f"tokens[{i}]", f"{json.dumps(t)} is not a non-negative integer"
        if t >= 2**31:
            return f"tokens[{i}]", f"{t} is too large for a token id"
    if vocab_size is not None:
        return check_vocab(value, vocab_size)
    return None


def check_vocab(tokens: Sequence[int] | np.ndarray, vocab_size: int) -> tuple[str, str] | None:
    """The first token outside [0, vocab_size), as (field, message)."""
    arr = np.asarray(tokens)
    bad = np.nonzero(arr >= vocab_size)[0]
    if len(bad):
        i = int(bad[0])
        return f"tokens[{i}]", f"{int(arr[i])} is outside the model's vocabulary (ids 0..{vocab_size - 1})"
    return None


def tokenize(item: PromptLine, tokenizer) -> np.ndarray:
    """The token ids of `item` for this tokenizer (an mlx-lm `TokenizerWrapper`).

    Text is encoded as `mlx_lm.stream_generate` encodes a string prompt (special tokens added
    unless the text already starts with BOS); messages go through the chat template with the
    generation prompt, as `mlx_lm.server` does. Raises ValueError if the tokenizer cannot.
    """
    if item.kind == "tokens":
        return np.asarray(item.value, dtype=np.int32)
    if item.kind == "prompt":
        text = item.value
        bos = getattr(tokenizer, "bos_token", None)
        add_special = bos is None or not text.startswith(bos)
    else:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the model's tokenizer has no chat template: use \"prompt\" or \"tokens\"")
        # Rendered, then encoded without added specials: what tokenize=True does inside transformers.
        text = tokenizer.apply_chat_template(item.value, add_generation_prompt=True, tokenize=False)
        add_special = False
    return _encode(tokenizer, text, add_special)


def _encode(tokenizer, text: str, add_special: bool) -> np.ndarray:
    # verbose=False: the caller reports prompts longer than the context itself.
    try:
        ids = tokenizer.encode(text, add_special_tokens=add_special, verbose=False)
    except TypeError:  # a tokenizer that is not a transformers one
        ids = tokenizer.encode(text, add_special_tokens=add_special)
    return np.asarray(ids, dtype=np.int32).reshape(-1)


def cache_types(item: PromptLine, tokenizer, tokens: np.ndarray) -> tuple[str, int]:
    """(the cache type of the prompt, how many of its first tokens are its system prompt), as
    `mlx_lm.server` types them: a prompt whose last message is the user's is "user" (else
    "assistant"), and its leading system messages are "system". A text or token line is "user",
    with no system prompt: a warmed prompt counts as a request's prompt would."""
    if item.kind != "messages":
        return "user", 0
    whole = "user" if item.value[-1]["role"] == "user" else "assistant"
    system = 0
    while system < len(item.value) and item.value[system]["role"] == "system":
        system += 1
    if not system:
        return whole, 0
    # The system messages with an empty user turn, rendered: where they stop matching the prompt.
    text = tokenizer.apply_chat_template(item.value[:system] + [{"role": "user", "content": ""}],
                                         add_generation_prompt=False, tokenize=False)
    ids = _encode(tokenizer, text, False)[: len(tokens)]
    differ = np.nonzero(ids != tokens[: len(ids)])[0]
    end = int(differ[0]) if len(differ) else len(ids)
    return whole, end if end < len(tokens) else 0


def _kinds() -> str:
    return ", ".join(f'"{k}"' for k in KINDS)


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__
