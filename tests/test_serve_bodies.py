"""Odd request bodies and clients that hang up, against a real `kvstore serve` on 127.0.0.1: each
gets a 4xx naming its field (never a bare Python message, never a 404), an answer already begun
is never cut by a field mlx_lm.server reads late, and nothing puts a traceback in the log."""

from __future__ import annotations

import json
import os
import socket
import time

import requests
from test_server import REQUEST_TIMEOUT, Server, ask

HI = [{"role": "user", "content": "hi"}]


def test_misshapen_fields_are_refused_by_name(demo_model, tmp_path):
    log_path = tmp_path / "server.log"
    with Server(demo_model("llama"), tmp_path / "store", log_path) as server:
        chat = server.url + "/v1/chat/completions"
        refused = [  # (body, what the error names); mlx_lm.server 0.32 answered these 404 "'role'",
            # 404 "'text'", or cut the answer after its 200 with a traceback in the log.
            ({"messages": []}, "messages is empty"),
            ({"messages": [{"content": "hi"}]}, "messages[0].role is missing"),
            ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0]"),
            ({"messages": [{"role": "user", "content": [{"type": "audio"}]}]}, "not a text or image part"),
            # Stock, these were rendered as "123" and "{'text': 'hi'}" into the prompt, and answered.
            ({"messages": [{"role": "user", "content": 123}]}, "messages[0].content is a JSON number"),
            ({"messages": [{"role": "user", "content": {"text": "hi"}}]}, "messages[0].content is a JSON object"),
            ({"messages": HI, "tools": "x"}, "tools"),
            ({"messages": HI, "chat_template_kwargs": [1]}, "chat_template_kwargs"),
            ({"messages": HI, "seed": 2**64}, "seed"),
            ({"messages": HI, "seed": -1}, "seed"),
            ({"messages": HI, "stream": True, "stream_options": "usage"}, "stream_options"),
            ({"messages": HI, "stream": True, "stream_options": {"include_usage": "yes"}}, "include_usage"),
            # Stock, these padded the prompt past the context check (max_length 40000 is minutes of
            # prefill with every other request waiting), failed the generation loop, or answered
            # 404 or 500 with a bare Python message.
            ({"messages": HI, "chat_template_kwargs": {"padding": "max_length", "max_length": 300}}, "max_length"),
            ({"messages": HI, "chat_template_kwargs": {"return_tensors": "np"}}, "sets return_tensors"),
            ({"messages": HI, "chat_template_kwargs": {"tokenize": False}}, "sets tokenize"),
            ({"messages": HI, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}, "sets chat_template"),
            ({"messages": HI, "logit_bias": {"5": None}}, 'logit_bias["5"] is a JSON null'),
            ({"messages": [{"role": "assistant", "tool_calls": "x"}, *HI]}, "messages[0].tool_calls is a JSON string"),
            ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"arguments": "{"}}]}, *HI]},
             "messages[0].tool_calls[0].function.arguments is not JSON"),
            ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": 5}]}]}, "without a string url"),
            ({"messages": HI, "model": 5}, "its model is a JSON number"),  # (stock: "requested_model ...")
            ({"messages": HI, "draft_model": 5}, "its draft_model is a JSON number"),  # (stock: a 404)
            ({"messages": HI, "max_tokens": True}, "max_tokens is a JSON boolean"),  # (stock: one token)
            ({"messages": HI, "max_completion_tokens": "x"}, "max_completion_tokens is a JSON string"),
        ]
        for body, named in refused:
            r = requests.post(chat, json={"max_tokens": 2, **body}, timeout=REQUEST_TIMEOUT)
            assert r.status_code == 400 and named in r.json()["error"], (body, r.status_code, r.text)
        r = requests.post(server.url + "/v1/chat/completions/render", json={"messages": [{"content": "hi"}]},
                          timeout=REQUEST_TIMEOUT)
        assert r.status_code == 400 and "role is missing" in r.json()["error"], r.text
        # OpenAI's stream_options without include_usage (false): the whole stream, without usage.
        r = requests.post(chat, json={"messages": HI, "max_tokens": 2, "stream": True, "stream_options": {}},
                          timeout=REQUEST_TIMEOUT)
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") and '"usage"' not in r.text
        for path in (b"/v1/chat/completions", b"/kvstore/prefetch"):  # (read as an empty body: "Invalid JSON")
            with socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT) as s:
                s.sendall(b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          b"Content-Length: -1\r\n\r\n{}" % path)
                answer = s.makefile("rb").read()  # (then the server closes the connection)
            assert answer.startswith(b"HTTP/1.0 400") and b"Content-Length header: -1 is negative" in answer, answer
        r = requests.post(chat, json={"messages": HI, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}},
                          timeout=REQUEST_TIMEOUT)  # (a variable of the template is no argument of the call)
        assert r.status_code == 200, r.text
        text, usage = ask(server, messages=HI, max_tokens=2, seed=2**64 - 1)
        assert usage["completion_tokens"] == 2
        assert server.stop() == 0
    out = log_path.read_text(errors="replace")
    assert "Traceback" not in out and "generation thread died" not in out


def test_a_client_that_hangs_up_mid_stream_is_one_line(demo_model, tmp_path):
    """Stock, a stream whose client closed the connection printed socketserver's traceback of the
    BrokenPipeError; the server goes on serving either way."""
    log_path = tmp_path / "server.log"
    with Server(demo_model("llama"), tmp_path / "store", log_path) as server:
        body = json.dumps({"messages": HI, "max_tokens": 2000, "stream": True}).encode()
        with socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n" % len(body) + body)
            seen = b""
            while b"data: " not in seen:  # (the stream has begun)
                got = s.recv(65536)
                assert got, seen
                seen += got
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        # Reset before the request line, and halfway through a body.
        for sent in (b"", b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{"):
            with socket.create_connection(("127.0.0.1", server.port), timeout=REQUEST_TIMEOUT) as s:
                s.sendall(sent)
                time.sleep(0.3)
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        deadline = time.monotonic() + REQUEST_TIMEOUT
        while server.log().count("hung up") < 3 and time.monotonic() < deadline:
            time.sleep(0.2)
        text, _ = ask(server, messages=HI, max_tokens=2)
        assert text is not None
        assert server.stop() == 0
    out = log_path.read_text(errors="replace")
    assert "the client of POST /v1/chat/completions hung up before the end of its answer" in out
    assert "the client of POST /v1/completions hung up before the end of its answer" in out
    assert "a client hung up before its request was read (ConnectionResetError)" in out
    assert "Traceback" not in out


# A stand-in for a failure in mlx_lm.server's handler after it queued its 200 but before it sent it.
BROKEN_HANDLER = """
import sys
import mlx_lm.server as server

generate_response = server.APIHandler.generate_response

def broken(self, text, *args, **kwargs):
    if self.body.get("max_tokens") == 3:
        raise KeyError("a defect of the handler on this input")
    return generate_response(self, text, *args, **kwargs)

server.APIHandler.generate_response = broken
from kvstore.serve.server import run
run(sys.argv[1:])
"""


def test_a_handler_failure_is_a_500_not_a_dropped_connection(demo_model, tmp_path):
    script = tmp_path / "broken_handler.py"
    script.write_text(BROKEN_HANDLER)
    log_path = tmp_path / "server.log"
    with Server(demo_model("llama"), tmp_path / "store", log_path, launcher=(str(script),)) as server:
        r = requests.post(server.url + "/v1/chat/completions", json={"messages": HI, "max_tokens": 3},
                          timeout=REQUEST_TIMEOUT)
        assert r.status_code == 500 and "KeyError" in r.json()["error"], r.text
        assert "defect" not in r.text  # (a message may quote the prompt: only its type)
        text, _ = ask(server, messages=HI, max_tokens=2)
        assert text is not None
        assert server.stop() == 0
    out = log_path.read_text(errors="replace")
    assert "kvstore serve: POST /v1/chat/completions failed: KeyError at" in out
    assert "Traceback" not in out and "defect" not in out


def test_a_model_that_does_not_load_leaves_the_served_one_loaded(demo_model, tmp_path):
    """OpenAI clients always send `model`. Stock, a name that does not load ("gpt-4", a folder
    without a model) unloaded the served model first: the request got 404 with the loader's
    message (a Hub connection error), and render answered 503 "no model is loaded yet" until
    some later request loaded it back."""
    model = demo_model("llama")
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    log_path = tmp_path / "server.log"
    with Server(model, tmp_path / "store", log_path, env=env) as server:
        for name in ("gpt-4", str(tmp_path)):
            r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "model": name},
                              timeout=REQUEST_TIMEOUT)
            assert r.status_code == 404, r.text
            error = r.json()["error"]
            assert f"the model {name!r} cannot be loaded here" in error, error
            assert f"this server serves {str(model)!r} (GET /v1/models)" in error, error
            r = requests.post(server.url + "/v1/completions/render", json={"prompt": "hi"}, timeout=REQUEST_TIMEOUT)
            assert r.status_code == 200 and r.json()[0]["token_ids"] == list(b"hi"), r.text
        # A draft model that does not load is named as such, not as the served model it came with.
        r = requests.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "draft_model": "nope"},
                          timeout=REQUEST_TIMEOUT)
        assert r.status_code == 404, r.text
        error = r.json()["error"]
        assert "the draft model 'nope' cannot be loaded here" in error and "leave draft_model out" in error, error
        text, usage = ask(server, prompt="hi", max_tokens=2)
        assert text is not None and usage["completion_tokens"] == 2
        assert server.stop() == 0
    out = log_path.read_text(errors="replace")
    assert "kvstore serve: a request named the model 'gpt-4', which does not load" in out
    assert "kvstore serve: a request named the draft model 'nope', which does not load" in out
    assert f"{model} is loaded again" in out and "Traceback" not in out
