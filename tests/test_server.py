"""`kvstore serve` end to end: real HTTP on 127.0.0.1 against `python -m kvstore.serve.server` subprocesses
serving tiny demo-builder models. Every wait is bounded; every server is killed in `finally`."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import pytest
import requests
from mlx_lm import load

import kvstore
from kvstore.demo import EOS_ID, IM_END_ID
from kvstore.serve.server import PersistentPromptCache
from kvstore.serve.server import main as serve_main

START_TIMEOUT = 90
REQUEST_TIMEOUT = 120
STOP_TIMEOUT = 60

SYSTEM = "You are a terse assistant. Answer in one short sentence, and never apologise."
QUESTION = "What does a prompt cache keep between two requests?"
# The demo models rarely pick an end token; forbidding them makes the lengths predictable.
NO_END = {str(EOS_ID): -100.0, str(IM_END_ID): -100.0}


@pytest.fixture(scope="module")
def models(demo_model):
    return {arch: demo_model(arch) for arch in ("llama", "gemma3_text", "qwen3_5")}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`python -m kvstore.serve.server` in a subprocess, logging to a file."""

    def __init__(self, model: Path | None, store: Path, log: Path, *extra: str, env=None,
                 launcher: tuple[str, ...] = ("-m", "kvstore.serve")):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log
        self._log = open(log, "ab")
        cmd = [sys.executable, *launcher, *(["--model", str(model)] if model else []),
               "--store", str(store), "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=Path(__file__).parent.parent, env=env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self) -> "Server":
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise AssertionError(f"server not ready after {START_TIMEOUT}s:\n{self.log()}")

    def stop(self) -> int:
        """SIGTERM, and the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"server did not exit {STOP_TIMEOUT}s after SIGTERM:\n{self.log()}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=STOP_TIMEOUT)
        self._log.close()

    def __enter__(self) -> "Server":
        try:
            return self.wait_ready()
        except BaseException:
            self.kill()
            raise

    def __exit__(self, *exc) -> None:
        self.kill()


def chat_messages(extra_turns=()):
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}, *extra_turns]


def ask(server: Server, *, messages=None, prompt=None, stream=False, max_tokens=12, **body):
    """One request; returns (text, usage). Chat if `messages`, else a text completion."""
    chat = messages is not None
    body = {"max_tokens": max_tokens, "temperature": 0.0, "logit_bias": NO_END, "stream": stream, **body}
    if chat:
        body["messages"] = messages
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    url = server.url + ("/v1/chat/completions" if chat else "/v1/completions")
    r = requests.post(url, json=body, stream=stream, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        choice = out["choices"][0]
        return (choice["message"]["content"] if chat else choice["text"]), out["usage"]
    text, usage = [], None
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if event.get("usage"):
            usage = event["usage"]
        for choice in event.get("choices", []):
            piece = choice["delta"].get("content") if chat else choice.get("text")
            text.append(piece or "")
    assert usage is not None, "the stream carried no usage block"
    return "".join(text), usage


def cached(usage) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def records(store: Path) -> int:
    with kvstore.open(store) as s:
        stats = s.stats()
    return stats["chunks"] + stats["tails"]


# -- restart survival --------------------------------------------------------------------------


def test_restart_survival(models, tmp_path):
    store, log = tmp_path / "store", tmp_path / "server.log"
    first = Server(models["llama"], store, log)
    with first:
        text1, usage1 = ask(first, messages=chat_messages())
        assert cached(usage1) == 0
        assert usage1["completion_tokens"] == 12
        assert first.stop() == 0
    assert "reused from the store" in first.log()

    second = Server(models["llama"], store, log)
    with second:
        text2, usage2 = ask(second, messages=chat_messages())
        prompt_tokens = usage2["prompt_tokens"]
        assert prompt_tokens == usage1["prompt_tokens"]
        assert cached(usage2) >= prompt_tokens - 1
        assert text2 == text1

        follow_up = chat_messages([{"role": "assistant", "content": text2},
                                   {"role": "user", "content": "And after a restart?"}])
        text3, usage3 = ask(second, messages=follow_up)
        assert usage3["prompt_tokens"] > prompt_tokens
        assert cached(usage3) >= prompt_tokens
        assert second.stop() == 0
    # The follow-up, resumed from the stored first turn, says what a server with nothing stored says.
    with Server(models["llama"], tmp_path / "empty", tmp_path / "fresh.log") as fresh:
        text4, usage4 = ask(fresh, messages=follow_up)
        assert cached(usage4) == 0 and usage4["prompt_tokens"] == usage3["prompt_tokens"]
        assert fresh.stop() == 0
    assert len(text3) > 0 and text3 == text4
    out = second.log()
    assert "Starting httpd at 127.0.0.1" in out
    assert f"kvstore: store {store}" in out and "records" in out
    assert f"kvstore: prompt {prompt_tokens} tokens, {cached(usage2)} reused from the store" in out


CASES = [("chat", False, "batch"), ("chat", True, "batch"), ("completion", False, "batch"),
         ("completion", True, "batch"), ("chat", True, "single"), ("completion", False, "single")]


def test_streaming_and_whole_responses(models, tmp_path):
    """Both endpoints, streamed or not, on mlx_lm.server's batched path and on its one-at-a-time
    path (which it takes for a request with a seed): the same text from scratch, from the memory
    tier and, after a restart, from disk. (One pair of servers for every case, to keep it quick.)"""
    store = tmp_path / "store"

    def request(i, endpoint, path):
        # The case number first, so no two cases share more than a few leading tokens.
        if endpoint == "chat":
            body = {"messages": [{"role": "system", "content": f"{i}. {SYSTEM}"},
                                 {"role": "user", "content": QUESTION}]}
        else:
            body = {"prompt": f"{i}. {SYSTEM} {QUESTION}"}
        return dict(body, seed=7) if path == "single" else body

    first: dict[int, tuple] = {}
    with Server(models["llama"], store, tmp_path / "a.log") as a:
        for i, (endpoint, stream, path) in enumerate(CASES):
            text1, usage1 = ask(a, stream=stream, **request(i, endpoint, path))
            text2, usage2 = ask(a, stream=stream, **request(i, endpoint, path))  # memory tier
            assert len(text1) > 0 and text2 == text1, CASES[i]
            assert cached(usage1) < usage1["prompt_tokens"] // 2, CASES[i]
            assert cached(usage2) >= usage2["prompt_tokens"] - 1, CASES[i]
            first[i] = (text1, usage1)
        assert a.stop() == 0
    with Server(models["llama"], store, tmp_path / "b.log") as b:
        for i, (endpoint, stream, path) in enumerate(CASES):
            text3, usage3 = ask(b, stream=stream, **request(i, endpoint, path))  # disk
            assert text3 == first[i][0], CASES[i]
            assert cached(usage3) >= usage3["prompt_tokens"] - 1, CASES[i]
        assert b.stop() == 0


# -- two processes on one store ----------------------------------------------------------------


def test_two_servers_share_one_store(models, tmp_path):
    store = tmp_path / "store"
    prompt = SYSTEM + " Two servers, one store: " + QUESTION
    # Different kvstore and mlx_lm.server memory options on each: all of them must pass through.
    with Server(models["llama"], store, tmp_path / "a.log", "--memory-bytes", "0",
                "--store-max-bytes", "1GB") as a, \
         Server(models["llama"], store, tmp_path / "b.log", "--prompt-cache-bytes", "1MB",
                "--prompt-cache-size", "2") as b:
        text_a, usage_a = ask(a, prompt=prompt)
        assert cached(usage_a) == 0
        # A's writer flushes in the background, soon after the response: wait until its records
        # are in the index, as seen from a third process.
        model, tokenizer = load(str(models["llama"]))
        tokens = tokenizer.encode(prompt)
        assert len(tokens) == usage_a["prompt_tokens"]
        with kvstore.open(store) as s:
            mc = s.bind(model, str(models["llama"]))
            deadline = time.monotonic() + 30
            while mc.stored_length(tokens) < len(tokens) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert mc.stored_length(tokens) >= len(tokens), "server A never flushed its records"
        text_b, usage_b = ask(b, prompt=prompt)
        assert cached(usage_b) >= usage_b["prompt_tokens"] - 1
        assert text_b == text_a
        assert a.stop() == 0
        assert b.stop() == 0
    with kvstore.open(store) as s:
        assert s.verify() == []


# -- other cache types ---------------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3_5", "gemma3_text"])
def test_hybrid_and_sliding_window_across_restart(models, tmp_path, arch):
    """Served correctly across a restart, reusing exactly what the store can restore for this
    cache layout."""
    store = tmp_path / "store"
    with Server(models[arch], store, tmp_path / "a.log") as a:
        text1, usage1 = ask(a, messages=chat_messages(), max_tokens=16)
        assert cached(usage1) == 0
        assert a.stop() == 0

    model, tokenizer = load(str(models[arch]))
    prompt = tokenizer.apply_chat_template(chat_messages(), add_generation_prompt=True, tokenize=True)
    assert len(prompt) == usage1["prompt_tokens"]
    with kvstore.open(store) as s:
        mc = s.bind(model, str(models[arch]))
        assert s.verify() == []
        restorable = len(prompt) - len(mc.fetch(prompt)[1])

    with Server(models[arch], store, tmp_path / "b.log") as b:
        text2, usage2 = ask(b, messages=chat_messages(), max_tokens=16)
        assert b.stop() == 0
    assert usage1["completion_tokens"] == usage2["completion_tokens"] == 16
    assert text2 == text1
    assert cached(usage2) == restorable > 0
    for server in (a, b):  # every insert stored (recurrent layers have no offset to trim by)
        assert "failed, served without the store" not in server.log()


def test_quantized_kv_cache_across_restart(demo_model, tmp_path):
    """`--kv-bits`: caches past `--quantized-kv-start` are QuantizedKVCache, stored and restored as such.
    (The small demo model: the tiny one's head dim is below the smallest quantization group.)"""
    model = demo_model("llama", size="small")
    store = tmp_path / "store"
    flags = ("--kv-bits", "8", "--kv-group-size", "32", "--quantized-kv-start", "16")
    with Server(model, store, tmp_path / "a.log", *flags) as a:
        text1, usage1 = ask(a, messages=chat_messages())
        assert a.stop() == 0
    with Server(model, store, tmp_path / "b.log", *flags) as b:
        text2, usage2 = ask(b, messages=chat_messages())
        assert b.stop() == 0
    assert text2 == text1
    assert cached(usage1) == 0 and cached(usage2) >= usage2["prompt_tokens"] - 1


def test_draft_model_is_served_but_not_cached(models, tmp_path):
    """Speculative decoding appends the draft model's caches to the model's. mlx-lm's own in-RAM
    cache then changes the greedy text of a repeated request, so nothing is cached or stored."""
    store = tmp_path / "store"
    with Server(models["llama"], store, tmp_path / "a.log", "--draft-model", str(models["llama"])) as a:
        text1, usage1 = ask(a, messages=chat_messages())
        text2, usage2 = ask(a, messages=chat_messages())
        assert a.stop() == 0
    assert text1 == text2
    assert cached(usage1) == cached(usage2) == 0
    assert records(store) == 0
    assert "speculative decoding" in a.log()


# -- shutting down -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["batch", "single"])
def test_sigterm_while_generating(models, tmp_path, path):
    """Exit 0 promptly, on the batched path and on the one-at-a-time path (a request with a seed),
    whose request would otherwise run to its 20,000 tokens first."""
    store = tmp_path / "store"
    seed = {"seed": 3} if path == "single" else {}
    server = Server(models["llama"], store, tmp_path / "server.log")
    with server:
        ask(server, messages=chat_messages(), **seed)  # something for the writer to flush
        started = threading.Event()
        failure: list[BaseException] = []

        def long_request():
            body = {"messages": chat_messages(), "max_tokens": 20000, "temperature": 0.0,
                    "logit_bias": NO_END, "stream": True, **seed}
            try:
                with requests.post(server.url + "/v1/chat/completions", json=body, stream=True,
                                   timeout=REQUEST_TIMEOUT) as r:
                    for line in r.iter_lines():
                        if line.startswith(b"data: "):
                            started.set()
            except requests.RequestException:
                pass  # the server went away mid-stream: expected
            except BaseException as e:
                failure.append(e)
            finally:
                started.set()

        client = threading.Thread(target=long_request, daemon=True)
        client.start()
        assert started.wait(REQUEST_TIMEOUT)
        assert client.is_alive() and server.proc.poll() is None, "the long request ended before SIGTERM"
        assert server.stop() == 0, server.log()
        client.join(STOP_TIMEOUT)
        assert not failure
    assert "kvstore: flushing pending writes" in server.log()
    with kvstore.open(store) as s:
        assert s.verify() == []
        stats = s.stats()
    assert stats["chunks"] + stats["tails"] > 0


# -- command line and library --------------------------------------------------------------------


def test_model_defaults_to_the_demo_model(tmp_path):
    """No --model: the built-in demo model (built under $HOME), and the note about it, once."""
    from kvstore.demo import DEMO_NOTE

    env = dict(os.environ, HOME=str(tmp_path / "home"))
    with Server(None, tmp_path / "store", tmp_path / "server.log", env=env) as server:
        text, usage = ask(server, prompt="Hello, demo model.")
        assert text and usage["prompt_tokens"] == len("Hello, demo model.")
        assert server.stop() == 0
    assert server.log().count(DEMO_NOTE) == 1
    assert any((tmp_path / "home" / ".cache" / "kvstore-demo").iterdir())


def test_help_lists_kvstore_and_mlx_lm_options():
    out = subprocess.run([sys.executable, "-m", "kvstore.serve", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    for flag in ("--store", "--store-max-bytes", "--memory-bytes", "--buffer-cache-bytes", "--store-max-tokens",
                 "--allowed-origins",
                 "--prompt-cache-size", "--port", "/metrics"):
        assert flag in out.stdout
    assert "default: *" not in out.stdout  # mlx_lm.server's own --allowed-origins entry is left out


@pytest.mark.parametrize("how", ["no weights", "no config", "not downloaded"])
def test_a_model_that_does_not_load_is_one_line_and_exit_1(models, tmp_path, how):
    """As `generate` does: one line naming the model, exit 1, no HTTP server left answering 503
    (mlx_lm.server loads the model in its generation thread, which then dies quietly)."""
    model = tmp_path / "model"
    if how == "not downloaded":  # the README's example on a machine that has not downloaded it
        model, expected = "kvstore-tests/not-downloaded", "cannot load model kvstore-tests/not-downloaded: "
    else:
        shutil.copytree(models["llama"], model)
        for f in model.glob("*.safetensors" if how == "no weights" else "config.json"):
            f.unlink()
        expected = f"cannot load model {model}: " if how == "no weights" else f"model folder {model} has no config.json"
    env = dict(os.environ, HOME=str(tmp_path / "home"), HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "kvstore.serve", "--model", str(model), "--store",
                          str(tmp_path / "store"), "--port", str(free_port())],
                         capture_output=True, text=True, timeout=START_TIMEOUT, env=env)
    assert out.returncode == 1, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("kvstore serve:")]
    assert len(errors) == 1 and expected in errors[0], out.stderr
    for never in ("Traceback", "generation loop", "generation thread died", "Starting httpd"):
        assert never not in out.stderr, out.stderr


def test_a_port_in_use_is_named(models, tmp_path):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "kvstore.serve", "--model", str(models["llama"]), "--store",
                              str(tmp_path / "store"), "--port", str(port)],
                             capture_output=True, text=True, timeout=START_TIMEOUT)
    assert out.returncode == 1, out.stderr
    assert f"kvstore serve: cannot listen on 127.0.0.1:{port}: Address already in use" in out.stderr, out.stderr
    # A host that names no address is named too (it was "cannot serve: [Errno -2] Name or service
    # not known", with no address).
    out = subprocess.run([sys.executable, "-m", "kvstore.serve", "--model", str(models["llama"]), "--store",
                          str(tmp_path / "store"), "--port", str(port), "--host", "no-such-host.invalid"],
                         capture_output=True, text=True, timeout=START_TIMEOUT)
    assert out.returncode == 1, out.stderr
    assert f"kvstore serve: cannot listen on no-such-host.invalid:{port}: " in out.stderr, out.stderr
    assert "give --host an IP address, or a name that resolves to one" in out.stderr, out.stderr
    # mlx_lm.server listened on 99999 % 65536 = 34463 and logged "on port 99999".
    out = subprocess.run([sys.executable, "-m", "kvstore.serve", "--model", str(models["llama"]), "--store",
                          str(tmp_path / "store"), "--port", "99999"],
                         capture_output=True, text=True, timeout=START_TIMEOUT)
    assert out.returncode == 2, out.stderr
    assert "argument --port: 99999 is no TCP port: give 1 to 65535" in out.stderr, out.stderr


def test_the_log_counts_in_the_right_words(models, tmp_path):
    """The disk's count is records, not "sequences"; one is "1 sequence", not "1 sequences"; no
    remote tier is said as such. (mlx_lm.server logs the counts before each request.) The start
    line names the settings that are not defaults, a kept 0 write rate plainly; each stored
    request says where its tokens went, and the writer what it kept in RAM and why."""
    store = tmp_path / "store"
    with kvstore.open(store, admit="reused"):
        pass
    with sqlite3.connect(store / "index.sqlite") as conn:  # a 0 kept before 0 was refused
        conn.execute("INSERT INTO meta (key, value) VALUES ('setting.max_write_rate', '0')")
    with Server(models["llama"], store, tmp_path / "server.log") as server:
        ask(server, prompt=SYSTEM)
        ask(server, prompt=SYSTEM)
        assert server.stop() == 0
    log = server.log()
    assert re.search(r"settings: admit=reused \(kept\), max_write_rate=0 B/day "
                     r"\(kept\): automatic writes never reach the disk", log), log
    assert "(given)" not in log  # serve's own automatic disk budget is its default, not given
    # (queued, and where they go the writer decides: no promise of the disk)
    queued = re.search(r"kvstore: cache of \d+ tokens up to record ([0-9a-f]{8}): 0 on disk, \d+ queued for the "
                       r"writer \(admission or the write budget decides: disk or RAM only\)", log)
    assert queued, log
    # the writer's line names the same record, so that the log ties it to the request that queued it
    assert re.search(r"kvstore: \d+ tokens \((not admitted|over budget)\)(, \d+ tokens \(\w+ \w+\))? up to "
                     rf"record {queued.group(1)} stay in RAM only", log), log
    assert "; no remote tier" in log
    assert re.search(r"- kvstore disk: \d+ records?, ", log) and "Prompt Cache: 1 sequence in RAM" in log, log
    assert not re.search(r"kvstore disk: \d+ sequence|\b1 sequences\b|\b1 requests\b", log), log
    assert "stopped: 2 requests, " in log, log
    # what reached the disk, and what the exit loses, said at the end
    assert "written to disk: 0 records (0 B)" in log, log
    assert re.search(r"; \d+ records? kept in RAM only (is|are) not on disk, lost now \((not admitted|over budget): "
                     r"\d+", log), log


# Argument errors come before anything starts: `main` in this process is the same code without a
# start-up each (`--help` above runs as a process, through `run`'s exit).


def test_bad_size_is_a_clean_error(tmp_path, capsys):
    assert serve_main(["--store", str(tmp_path / "s"), "--memory-bytes", "lots"]) == 2
    err = capsys.readouterr().err
    assert "--memory-bytes" in err and "not a size" in err
    # mlx_lm.server's own option, which it reads only after the model is loaded: a traceback
    # (decimal.InvalidOperation, or KeyError for '8GiB') then, a clean refusal here.
    for size in ("lots", "8GiB"):
        assert serve_main(["--store", str(tmp_path / "s"), "--prompt-cache-bytes", size]) == 2
        err = capsys.readouterr().err
        assert f"argument --prompt-cache-bytes: {size!r} is not a size mlx_lm.server reads" in err, err


def test_a_typo_names_the_option_it_resembles(tmp_path, capsys):
    """Options neither kvstore nor mlx_lm.server knows are refused by kvstore serve, with the one
    meant: mlx_lm.server's own usage lists no --store. A negative size says it is negative."""
    for args, message in ((["--stroe", str(tmp_path / "s")], "unknown option --stroe (did you mean --store?)"),
                          (["--prot", "8080"], "unknown option --prot (did you mean --port?)"),
                          (["--store-max-bytes", "-5MB"], "argument --store-max-bytes: '-5MB' is negative"),
                          # 0 is refused too: the least it takes is 1
                          (["--kv-events-block-size", "-16"], "-16 is negative: give 1 or more")):
        code = serve_main(args)
        err = capsys.readouterr().err
        assert code == 2, err
        assert message in err and "usage: kvstore serve" in err, err
        assert "--adapter-path" not in err  # not mlx_lm.server's usage
    assert not (tmp_path / "s").exists()


def test_persistent_prompt_cache_in_process(models, tmp_path):
    """The library surface for own servers: register a model, fetch, insert, fall back, never raise."""
    model, tokenizer = load(str(models["llama"]))
    tokens = tokenizer.encode(SYSTEM + " " + QUESTION)
    with kvstore.open(tmp_path / "store", chunk_size=16) as store:
        cache = PersistentPromptCache(store)
        cache.register("llama", store.bind(model, str(models["llama"])))
        assert cache.fetch_nearest_cache("llama", tokens) == (None, tokens)

        prompt_cache = store.bind(model, str(models["llama"])).new_cache()
        model(mx.array([tokens]), cache=prompt_cache)
        cache.insert_cache("llama", tokens, prompt_cache, cache_type="system")
        restored, rest = cache.fetch_nearest_cache("llama", tokens + [65, 66])
        assert rest == [65, 66] and restored[0].offset == len(tokens)
        store.flush()
        assert len(cache) == 1 and cache.nbytes == store.memory.nbytes > 0
        by_type = cache.stats_by_type()
        assert by_type["system"] == {"n_sequences": 1, "n_bytes": cache.nbytes}
        assert by_type["assistant"]["n_sequences"] == by_type["user"]["n_sequences"] == 0
        assert by_type["kvstore disk"]["n_bytes"] > 0

        # Keys it cannot store go to mlx-lm's own in-RAM LRUPromptCache.
        cache.insert_cache("other", tokens, prompt_cache)
        restored, rest = cache.fetch_nearest_cache("other", tokens + [65])
        assert restored is not None and rest == [65]
        image_key = [-5] * 3 + tokens  # mlx_lm.server marks image patches with negative ids
        assert cache.fetch_nearest_cache("llama", image_key) == (None, image_key)

        # Garbage in: logged and counted, never raised into the server.
        cache.insert_cache("llama", tokens, prompt_cache[:1])
        assert cache.counters["errors"] == 1
        store.flush()
        cache.trim_to(n_bytes=0)
        assert cache.nbytes == 0
        assert store.verify() == []


def test_serving_freezes_what_start_up_made():
    """What exists when the HTTP server starts (the model, the libraries) lives as long as the
    server: frozen, so that Python's full collections stop walking it in the middle of requests."""
    import gc
    import types

    from kvstore.serve.mlxserver import persistent

    served = []
    fake = types.SimpleNamespace(ResponseGenerator=object, APIHandler=object,
                                 _run_http_server=lambda host, port, gen, handler_class=None: served.append(
                                     (gc.get_freeze_count(), handler_class)))
    gc.unfreeze()
    try:
        with persistent(fake, None, [], {}, lambda base: ("ours", base)):
            fake._run_http_server("127.0.0.1", 0, None)
        [(frozen, handler)] = served
        assert frozen > 1000 and handler == ("ours", object)
    finally:
        gc.unfreeze()


def wait_stored(model_dir: Path, store: Path, prompt: str, timeout: float = 30) -> None:
    """Until a third process sees `prompt` stored whole (the server writes in the background)."""
    model, tokenizer = load(str(model_dir))
    tokens = tokenizer.encode(prompt)
    with kvstore.open(store) as s:
        mc = s.bind(model, str(model_dir))
        deadline = time.monotonic() + timeout
        while mc.stored_length(tokens) < len(tokens) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mc.stored_length(tokens) >= len(tokens), "the server never wrote the prompt"


# -- operating it: /metrics, /kvstore/stats, /v1/models --------------------------------------------


def scrape(server: Server) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, parsed by prometheus_client's own parser: (name, labels) -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    r = requests.get(server.url + "/metrics", timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(r.text) for s in family.samples}


def test_metrics_count_real_requests(models, tmp_path):
    store = tmp_path / "store"
    prompt = SYSTEM + " Metrics: " + QUESTION
    reused = ("kvstore_reused_tokens_total", (("tier", "memory"),))
    from_disk = ("kvstore_reused_tokens_total", (("tier", "disk"),))
    with Server(models["llama"], store, tmp_path / "a.log") as a:
        before = scrape(a)
        for name in ("kvstore_requests_total", "kvstore_prompt_tokens_total", "kvstore_inserts_total",
                     "kvstore_fetch_errors_total", "kvstore_quarantined_total", "kvstore_store_bytes",
                     "kvstore_memory_bytes", "kvstore_write_queue_bytes", "kvstore_fetch_seconds_count",
                     "kvstore_restored_tokens_count"):
            assert (name, ()) in before, name
        assert ("kvstore_dropped_writes_total", (("reason", "queue_full"),)) in before
        assert ("kvstore_records", (("kind", "tail"),)) in before
        assert not any(name.startswith("kvstore_remote") for name, _ in before)  # no remote tier

        _, usage1 = ask(a, prompt=prompt)
        _, usage2 = ask(a, prompt=prompt)  # the repeated prompt: reused from the memory tier
        n = usage1["prompt_tokens"]
        assert cached(usage1) == 0 and cached(usage2) == n - 1
        after = scrape(a)
        assert after[("kvstore_requests_total", ())] - before[("kvstore_requests_total", ())] == 2
        assert after[("kvstore_prompt_tokens_total", ())] - before[("kvstore_prompt_tokens_total", ())] == 2 * n
        assert after[reused] - before[reused] == cached(usage2)
        assert after[from_disk] == before[from_disk] == 0
        assert after[("kvstore_inserts_total", ())] - before[("kvstore_inserts_total", ())] >= 2
        assert after[("kvstore_fetch_seconds_count", ())] == 2
        assert after[("kvstore_restored_tokens_sum", ())] == cached(usage2)
        assert after[("kvstore_restored_tokens_bucket", (("le", "0.0"),))] == 1  # the first was a miss

        stats = requests.get(a.url + "/kvstore/stats", timeout=REQUEST_TIMEOUT)
        assert stats.status_code == 200 and stats.headers["Content-Type"] == "application/json"
        body = stats.json()
        assert {"bytes", "chunks", "tails", "models", "memory", "writer"} <= set(body)
        # Bounded by default: the automatic disk budget.
        assert body["max_bytes_auto"] is True and body["max_bytes"] > 0
        assert a.stop() == 0

    with Server(models["llama"], store, tmp_path / "b.log") as b:  # after a restart: from disk
        _, usage3 = ask(b, prompt=prompt)
        after = scrape(b)
        assert after[from_disk] == cached(usage3) == n - 1
        assert after[reused] == 0
        assert after[("kvstore_records", (("kind", "tail"),))] >= 1
        assert after[("kvstore_store_bytes", ())] == requests.get(b.url + "/kvstore/stats").json()["bytes"] > 0
        assert b.stop() == 0


def test_read_only_endpoints_answer_while_generating(models, tmp_path):
    """mlx_lm.server is a ThreadingHTTPServer: the new endpoints answer during a long generation."""
    server = Server(models["llama"], tmp_path / "store", tmp_path / "server.log")
    with server:
        first_token = threading.Event()
        done = threading.Event()

        def long_request():
            body = {"messages": chat_messages(), "max_tokens": 20000, "temperature": 0.0,
                    "logit_bias": NO_END, "stream": True}
            try:
                with requests.post(server.url + "/v1/chat/completions", json=body, stream=True,
                                   timeout=REQUEST_TIMEOUT) as r:
                    for line in r.iter_lines():
                        if line.startswith(b"data: "):
                            first_token.set()
            except requests.RequestException:
                pass
            finally:
                first_token.set()
                done.set()

        client = threading.Thread(target=long_request, daemon=True)
        client.start()
        assert first_token.wait(REQUEST_TIMEOUT)
        for path in ("/metrics", "/kvstore/stats", "/v1/models", "/health"):
            r = requests.get(server.url + path, timeout=10)
            assert r.status_code == 200, path
        assert ("kvstore_requests_total", ()) in scrape(server)
        assert not done.is_set(), "the generation ended before the endpoints were asked"
        assert server.stop() == 0
        client.join(STOP_TIMEOUT)


def test_models_lists_the_served_model(models, tmp_path):
    """`GET /v1/models` is a valid list with the served model, with no Hugging Face cache folder and
    with one holding another mlx model; the listed id is a name a request may send. (One server:
    the cache folder is read at each request, and made between the two rounds.)"""
    hf_cache = tmp_path / "hf"
    env = dict(os.environ, HF_HUB_CACHE=str(hf_cache))
    with Server(models["llama"], tmp_path / "store", tmp_path / "server.log", env=env) as server:
        for with_cache in (False, True):
            if with_cache:  # a downloaded mlx model, laid out as huggingface_hub lays it out
                repo = hf_cache / "models--mlx-community--Other-4bit"
                snap = repo / "snapshots" / "abc123"
                snap.mkdir(parents=True)
                (repo / "refs").mkdir()
                (repo / "refs" / "main").write_text("abc123")
                for name in ("config.json", "model.safetensors.index.json", "tokenizer_config.json"):
                    (snap / name).write_text("{}")
            else:
                assert not hf_cache.exists()  # a fresh machine: no cache folder at all
            r = requests.get(server.url + "/v1/models", timeout=REQUEST_TIMEOUT)
            assert r.status_code == 200
            body = r.json()
            assert body["object"] == "list"
            ids = [m["id"] for m in body["data"]]
            assert ids[0] == str(models["llama"])
            assert all(m["object"] == "model" and isinstance(m["created"], int) and m["owned_by"]
                       for m in body["data"])
            assert ("mlx-community/Other-4bit" in ids) == with_cache
            one = requests.get(server.url + "/v1/models/" + ids[0].lstrip("/"), timeout=REQUEST_TIMEOUT)
            missing = requests.get(server.url + "/v1/models/no/such-model", timeout=REQUEST_TIMEOUT)
            assert missing.status_code == 404
            # The listed id is the model to send: the served model answers under it.
            text, usage = ask(server, prompt="Which model?", model=ids[0])
            assert text and usage["prompt_tokens"] == len("Which model?")
            assert one.status_code == 200 and one.json()["id"] == ids[0]
        assert server.stop() == 0


# -- bounded by default: web origins, request bodies, the log ---------------------------------------


def test_cross_origin_requests_are_refused_by_default(models, tmp_path):
    """A web page may POST `text/plain` (or a form) to any address without asking first; with
    stock mlx_lm.server (`--allowed-origins` default `*`) that runs the model and writes the store.
    kvstore serve refuses it, and any request from a web origin it was not told to allow."""
    store = tmp_path / "store"
    body = json.dumps({"prompt": SYSTEM + " " + QUESTION, "max_tokens": 8})
    url_path = "/v1/completions"
    with Server(models["llama"], store, tmp_path / "server.log") as server:
        url = server.url + url_path
        page = requests.post(url, data=body, timeout=REQUEST_TIMEOUT,
                             headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})
        assert page.status_code == 403 and "Access-Control-Allow-Origin" not in page.headers
        assert "--allowed-origins" in page.json()["error"]
        as_json = requests.post(url, data=body, timeout=REQUEST_TIMEOUT,
                                headers={"Origin": "http://evil.example", "Content-Type": "application/json"})
        assert as_json.status_code == 403
        for content_type in ("text/plain;charset=UTF-8", "application/x-www-form-urlencoded"):
            r = requests.post(url, data=body, headers={"Content-Type": content_type}, timeout=REQUEST_TIMEOUT)
            assert r.status_code == 415 and "application/json" in r.json()["error"]
        preflight = requests.options(url, timeout=REQUEST_TIMEOUT, headers={
            "Origin": "http://evil.example", "Access-Control-Request-Method": "POST"})
        assert "Access-Control-Allow-Origin" not in preflight.headers
        stats = requests.get(server.url + "/kvstore/stats", timeout=REQUEST_TIMEOUT).json()
        assert scrape(server)[("kvstore_requests_total", ())] == 0
        assert server.stop() == 0
    assert stats["tails"] == stats["chunks"] == 0
    assert records(store) == 0

    # Asked for: that origin is served and may read the answers; others are still refused.
    with Server(models["llama"], store, tmp_path / "allowed.log",
                "--allowed-origins", "http://ok.example") as server:
        url = server.url + url_path
        ok = requests.post(url, data=body, timeout=REQUEST_TIMEOUT,
                           headers={"Origin": "http://ok.example", "Content-Type": "application/json"})
        assert ok.status_code == 200 and ok.headers["Access-Control-Allow-Origin"] == "http://ok.example"
        preflight = requests.options(url, timeout=REQUEST_TIMEOUT, headers={
            "Origin": "http://ok.example", "Access-Control-Request-Method": "POST"})
        assert preflight.headers["Access-Control-Allow-Origin"] == "http://ok.example"
        other = requests.post(url, data=body, timeout=REQUEST_TIMEOUT,
                              headers={"Origin": "http://evil.example", "Content-Type": "application/json"})
        assert other.status_code == 403
        assert server.stop() == 0


def test_malformed_bodies_never_reach_the_log(models, tmp_path):
    """mlx_lm.server logs a body that is not JSON raw, at ERROR: the user's prompt in the log."""
    marker = "MARKER-7f3a-private-prompt"
    log_path = tmp_path / "server.log"
    with Server(models["llama"], tmp_path / "store", log_path) as server:
        url = server.url + "/v1/chat/completions"
        bodies = ['{"messages": [{"role": "user", "content": "' + marker + '"}]',  # cut short
                  '["' + marker + '"]',  # JSON, not an object
                  '{"prompt": "' + marker + '", }',
                  b'{"prompt": "\xff' + marker.encode() + b'"}',  # not UTF-8
                  '{"prompt": "' + marker + '", "temperature": NaN}',  # no JSON number
                  '{"prompt": "' + marker + '\\ud800"}',  # a lone surrogate: no tokenizer takes it
                  '{"p": ' + "[" * 100_000 + "]" * 100_000 + "}"]  # nested too deeply to parse
        for raw in bodies:
            r = requests.post(url, data=raw, headers={"Content-Type": "application/json"},
                              timeout=REQUEST_TIMEOUT)
            assert r.status_code == 400 and "Invalid JSON" in r.json()["error"]
            assert marker not in r.text
        # Fields mlx_lm.server 0.32 hands unchecked to its generation loop, which dies on them.
        completions = server.url + "/v1/completions"
        for body in ({"prompt": [marker]}, {"prompt": ""}, {"prompt": None},
                     {"prompt": marker, "stop": [None]}, {"prompt": marker, "stop": 5}):
            r = requests.post(completions, json=body, timeout=REQUEST_TIMEOUT)
            assert r.status_code == 400 and ("prompt" in r.json()["error"] or "stop" in r.json()["error"])
        r = requests.post(url, json={"messages": 5, "max_tokens": 1}, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 400, r.text  # (no messages: answered, not a dropped connection)
        r = requests.post(completions, json={"prompt": "hi", "messages": 5, "max_tokens": 1}, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 200, r.text  # (a field completions do not read)
        r = requests.post(completions, json={"prompt": "hi", "logit_bias": {"100000000": 1}}, timeout=REQUEST_TIMEOUT)
        assert r.status_code == 400 and "not a token id of the model" in r.text  # (it killed the process)
        # What cannot fit the model's context (32,768 tokens) is refused before it is computed.
        for body, said in (({"prompt": "a" * (33 * 32768)}, "more than any tokenizer fits"),
                           ({"prompt": "a" * 40000, "max_tokens": 1}, "longer than the model's context"),
                           ({"prompt": marker, "max_tokens": 10**20}, "more than the model's context")):
            r = requests.post(completions, json=body, timeout=REQUEST_TIMEOUT)
            assert r.status_code == 400 and said in r.json()["error"], r.text
        text, _ = ask(server, prompt="still serving")
        assert text
        assert server.stop() == 0
    out = log_path.read_text(errors="replace")
    assert "refused a request to /v1/chat/completions" in out
    assert "generation thread died" not in out and "generation loop fail" not in out
    assert marker not in out


def test_tokens_stored_per_request_are_capped(models, tmp_path):
    store = tmp_path / "store"
    prompt = SYSTEM + " " + QUESTION  # far more than 16 tokens
    with Server(models["llama"], store, tmp_path / "server.log", "--store-max-tokens", "16") as server:
        text1, _ = ask(server, prompt=prompt)
        text2, usage2 = ask(server, prompt=prompt)
        assert text2 == text1 and cached(usage2) == 0  # served, never stored
        short, _ = ask(server, prompt="Hi.", max_tokens=4)  # 3 + 4 tokens: stored
        dropped = scrape(server)[("kvstore_dropped_writes_total", (("reason", "too_long"),))]
        assert dropped >= 2  # (mlx_lm.server may insert a request more than once: segments, then all)
        assert server.stop() == 0
    model, tokenizer = load(str(models["llama"]))
    with kvstore.open(store) as s:
        mc = s.bind(model, str(models["llama"]))
        assert mc.stored_length(tokenizer.encode(prompt)) == 0
        assert mc.stored_length(tokenizer.encode("Hi.")) == len("Hi.")


def test_non_loopback_host_is_warned_about(models, tmp_path):
    """A --host other than loopback gets a warning before anything listens (192.0.2.1 is a
    documentation address no machine has, so the bind fails and nothing is exposed)."""
    out = subprocess.run([sys.executable, "-m", "kvstore.serve", "--model", str(models["llama"]),
                          "--store", str(tmp_path / "store"), "--host", "192.0.2.1", "--port", str(free_port())],
                         capture_output=True, text=True, timeout=START_TIMEOUT, cwd=Path(__file__).parent.parent)
    assert "warning: listening on 192.0.2.1" in out.stderr
    assert out.returncode == 1 and "kvstore serve: cannot listen on 192.0.2.1:" in out.stderr


def test_loopback_hosts():
    from kvstore.serve.options import is_loopback

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.0.0.2")
    assert not is_loopback("0.0.0.0") and not is_loopback("::") and not is_loopback("192.0.2.1")


def test_serve_defaults_are_bounded():
    """Disk: the `auto` budget (`none` asks for an unbounded store); tokens stored per request:
    capped; web origins: none."""
    from kvstore import settings
    from kvstore.serve.options import server_settings
    from kvstore.serve.server import DEFAULT_MAX_STORED_TOKENS, _parser

    def parsed(*argv):
        args = _parser().parse_args(list(argv))
        return settings.given(args), server_settings(args)

    store, served = parsed()
    assert store == {} and settings.serve_defaults() == {"max_bytes": "auto"}  # serve's own default, not given
    assert served["store_max_tokens"] == DEFAULT_MAX_STORED_TOKENS == 32768
    assert served["allowed_origins"] == []
    assert parsed("--store-max-bytes", "none")[0]["max_bytes"] == "off"
    assert parsed("--store-max-bytes", "off")[0]["max_bytes"] == "off"
    for no_cap in ("0", "off", "none"):  # one word for no limit, as every setting takes
        assert parsed("--store-max-tokens", no_cap)[1]["store_max_tokens"] is None
    assert parsed("--allowed-origins", "http://a.example/, *")[1]["allowed_origins"] == ["http://a.example", "*"]


# A stand-in for an mlx_lm.server defect: one input its generation loop does not survive.
BROKEN_MLX_LM = """
import sys
import mlx_lm.server as server

make_state_machine = server.ResponseGenerator._make_state_machine

def broken(self, model_key, tokenizer, stop_words):
    if "BOOM" in stop_words:
        raise ValueError("a defect of mlx_lm.server on this input")
    return make_state_machine(self, model_key, tokenizer, stop_words)

server.ResponseGenerator._make_state_machine = broken
from kvstore.serve.server import run
run(sys.argv[1:])
"""


def test_a_request_that_breaks_mlx_lm_does_not_take_the_server_down(models, tmp_path):
    """Stock, a request that makes mlx_lm.server's generation loop raise ends it, and every later
    request fails ("generation thread died") while the process stays up. Here that request gets an
    error and the server goes on serving, with its cache."""
    script = tmp_path / "broken_mlx_lm.py"
    script.write_text(BROKEN_MLX_LM)
    log_path = tmp_path / "server.log"
    with Server(models["llama"], tmp_path / "store", log_path, launcher=(str(script),)) as server:
        text1, _ = ask(server, prompt=SYSTEM)
        bad = requests.post(server.url + "/v1/completions", timeout=REQUEST_TIMEOUT,
                            json={"prompt": SYSTEM, "max_tokens": 4, "stop": ["BOOM"]})
        assert bad.status_code != 200
        text2, usage2 = ask(server, prompt=SYSTEM)
        assert text2 == text1 and cached(usage2) == usage2["prompt_tokens"] - 1
        assert requests.get(server.url + "/health", timeout=10).status_code == 200
        assert server.stop() == 0
    out = log_path.read_text(errors="replace")
    assert "made mlx_lm.server's generation loop fail (ValueError at" in out
    assert "generation thread died" not in out


def test_prompt_cache_size_bounds_ram_and_the_disk_still_serves(models, tmp_path):
    """`--prompt-cache-size 1`: one sequence in RAM, as mlx-lm's own cache; the prompt RAM let go
    is then restored from disk (counted as such), with the same text."""
    store = tmp_path / "store"
    first, second = "1. " + SYSTEM + " " + QUESTION, "2. " + QUESTION + " " + SYSTEM
    memory = ("kvstore_reused_tokens_total", (("tier", "memory"),))
    disk = ("kvstore_reused_tokens_total", (("tier", "disk"),))
    with Server(models["llama"], store, tmp_path / "server.log", "--prompt-cache-size", "1") as server:
        text1, _ = ask(server, prompt=first)
        _, again = ask(server, prompt=first)  # still in RAM
        assert cached(again) == again["prompt_tokens"] - 1
        ask(server, prompt=second)  # evicts the first from RAM
        wait_stored(models["llama"], store, first)  # on disk, not only in the write queue
        before = scrape(server)
        text3, usage3 = ask(server, prompt=first)
        after = scrape(server)
        assert text3 == text1
        assert cached(usage3) == usage3["prompt_tokens"] - 1
        assert after[disk] - before[disk] == cached(usage3)
        assert after[memory] == before[memory]
        assert server.stop() == 0
