"""`kvstore serve` as a drop-in for `mlx_lm.server`: the same requests, at temperature 0, to a stock
`python -m mlx_lm server` and to `kvstore serve` on the same demo model get the same answers (the
same fields, text, finish reasons, logprobs, usage), batched or not, streamed or not, and again
from the store after kvstore serve restarts. Only ids, timestamps, `cached_tokens` and the
keep-alive comments (which count what was left after the cache) may differ."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
from test_server import REQUEST_TIMEOUT, START_TIMEOUT, Server, free_port

SYSTEM = "You answer in one short sentence. " * 12
CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What does a prompt cache keep?"}]
BODIES = [
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8}),
    ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 30, "stop": ["e", "o"]}),
    ("/v1/completions", {"prompt": "abc", "max_tokens": 4, "logprobs": True, "top_logprobs": 3}),
    ("/v1/completions", {"prompt": "xyz", "max_tokens": 6, "logit_bias": {"101": 100}, "stream": True}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "logprobs": True, "top_logprobs": 3}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "repetition_penalty": 1.3,
                              "presence_penalty": 0.5, "frequency_penalty": 0.5}),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, "stop": ["a"], "stream": True,
                              "stream_options": {"include_usage": True}}),
]
VOLATILE = {"id", "created", "system_fingerprint", "cached_tokens"}


class StockServer:
    """Stock `python -m mlx_lm server` in a subprocess."""

    def __init__(self, model, log):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "mlx_lm", "server", "--model", str(model),
                                      "--port", str(self.port)], stdout=self._log, stderr=subprocess.STDOUT)

    def __enter__(self):
        Server.wait_ready(self)  # (polls /health: all it reads is url and proc)
        return self

    def log(self) -> str:
        return open(self._log.name, errors="replace").read()

    def __exit__(self, *exc):
        self.proc.kill()
        self.proc.wait(timeout=START_TIMEOUT)
        self._log.close()


def answer(url: str, path: str, body: dict):
    r = requests.post(url + path, json={"temperature": 0, **body}, timeout=REQUEST_TIMEOUT)
    assert r.status_code == 200, r.text
    if not body.get("stream"):
        return r.json()
    # SSE: the data events in order (keep-alive comments count the uncached part: they differ)
    assert r.headers["Content-Type"] == "text/event-stream" and r.text.endswith("data: [DONE]\n\n"), r.text
    return [json.loads(line[6:]) for line in r.text.split("\n")
            if line.startswith("data: ") and line != "data: [DONE]"]


def answers(url: str) -> list:
    """Every body alone, then all of them at once (mlx_lm.server batches them)."""
    alone = [answer(url, path, body) for path, body in BODIES]
    with ThreadPoolExecutor(len(BODIES)) as pool:
        batched = list(pool.map(lambda pb: answer(url, *pb), BODIES))
    return alone + batched


def same(a, b, where="") -> None:
    """Equal but for VOLATILE fields; log-probabilities to 1e-4 (a prefix mlx_lm.server reuses from
    its own RAM shifts them in the sixth digit: the greedy tokens stay the same)."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), (where, a, b)
        for k in a:
            if k not in VOLATILE:
                same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), (where, a, b)
        for i, (x, y) in enumerate(zip(a, b)):
            same(x, y, f"{where}[{i}]")
    elif isinstance(a, float):
        assert b == pytest.approx(a, abs=1e-4), (where, a, b)
    else:
        assert a == b, (where, a, b)


def cached(answer_) -> int:
    usage = answer_[-1]["usage"] if isinstance(answer_, list) else answer_["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_answers_are_stock_mlx_lm_servers_cold_and_after_a_restart(demo_model, tmp_path):
    model = demo_model("llama")
    with StockServer(model, tmp_path / "stock.log") as stock:
        expected = answers(stock.url)
    for run in ("cold", "restarted"):
        with Server(model, tmp_path / "store", tmp_path / f"{run}.log") as server:
            got = answers(server.url)
            for i, (want, have) in enumerate(zip(expected, got)):
                same(want, have, f"{run} {BODIES[i % len(BODIES)]}")
            assert server.stop() == 0
        if run == "restarted":  # every chat prompt resumes from the store: all but its last token
            chats = [a for a, (path, _) in zip(got, BODIES) if path == "/v1/chat/completions"]
            assert all(cached(a) == (a[-1] if isinstance(a, list) else a)["usage"]["prompt_tokens"] - 1
                       for a in chats), [a["usage"] if isinstance(a, dict) else a[-1]["usage"] for a in chats]
