"""Time to first token through the HTTP server: stock `mlx_lm.server` against `kvstore serve`.

What a user of the server feels. Both servers run the same model in a process of their own, with
Debian's OpenBLAS preloaded when it is installed (else the mlx-cpu wheel's bundled BLAS; the
result says which). Each request is a streamed chat completion whose system prompt is the given
number of tokens (the demo model's tokenizer is byte-level: one token per byte) followed by a
short question; time to first token is from sending the request to the first chunk carrying the
first generated token, as a client sees it. Both servers are up at once and each request goes to
one and then the other, one request at a time. Per prompt length, `--reps` times with a different
system prompt each time:

- first:    a prompt never seen (both compute all of it)
- repeat:   the same request again (stock: its in-RAM `LRUPromptCache`; kvstore: its memory tier)
- shared:   another question after the same system prompt (both reuse the system prompt)
- restart:  the server stopped (SIGTERM) and started again, then the first request of each rep
            again (stock: computes it all again; kvstore: restores it from disk)

Each row gives the median, and the prompt tokens the server reported as cached
(`usage.prompt_tokens_details.cached_tokens`). Writes bench/results/serve.json.

    python bench/serve.py [--quick] [--tokens 2048 8192] [--reps 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common as C
import requests

from kvstore.demo import EOS_ID, IM_END_ID, ensure_demo_model

START_TIMEOUT_S = 120
REQUEST_TIMEOUT_S = 600
NO_END = {str(EOS_ID): -100.0, str(IM_END_ID): -100.0}  # the first token is never an end token
CASES = ("first", "repeat", "shared", "restart")
SERVERS = {
    "mlx_lm.server": lambda model, store, port: [sys.executable, "-m", "mlx_lm.server", "--model", str(model),
                                                 "--host", "127.0.0.1", "--port", str(port)],
    "kvstore serve": lambda model, store, port: [sys.executable, "-m", "kvstore.serve", "--model", str(model),
                                                 "--store", str(store), "--port", str(port)],
}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, kind: str, model: Path, store: Path, log: Path, env: dict):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log, "ab")
        self.proc = subprocess.Popen(SERVERS[kind](model, store, self.port), stdout=self.log,
                                     stderr=subprocess.STDOUT, env=env, cwd=str(C.REPO))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{kind} exited with {self.proc.returncode}; see {log}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{kind} not ready after {START_TIMEOUT_S} s; see {log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def first_token(server: Server, system: str, question: str) -> tuple[float, int]:
    """(seconds to the first generated token, prompt tokens the server says it reused)."""
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
            "max_tokens": 2, "temperature": 0.0, "logit_bias": NO_END, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    r = requests.post(server.url + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT_S)
    r.raise_for_status()
    ttft, usage = None, None
    for line in r.iter_lines():
        if not line.startswith(b"data: "):
            continue
        data = line[len(b"data: "):]
        if data == b"[DONE]":
            break
        event = json.loads(data)
        if ttft is None and any(c.get("delta", {}).get("content") or c.get("finish_reason")
                                for c in event.get("choices", [])):
            ttft = time.perf_counter() - started
        usage = event.get("usage") or usage
    if ttft is None or usage is None:
        raise RuntimeError("the stream carried no token or no usage block")
    return ttft, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def system_prompt(tokens: int, rep: int) -> str:
    """About `tokens` bytes of text (the byte-level tokenizer: one token a byte), different per
    length and rep from the first words on (no two share more than the chat template's start)."""
    words = ("cache", "token", "prefix", "restore", "layer", "tensor", "store", "prompt", "model", "disk")
    out, i = [f"Prompt {tokens}-{rep}. You are a helpful assistant."], rep * 7919 + tokens * 104729
    while sum(len(w) + 1 for w in out) < tokens - 64:  # room for the chat template's own tokens
        out.append(words[(i * 2654435761) % len(words)])
        i += 1
    return " ".join(out)


def start_all(model: Path, work: Path, env: dict) -> dict[str, Server]:
    servers: dict[str, Server] = {}
    try:
        for kind in SERVERS:
            servers[kind] = Server(kind, model, work / "store", work / f"{kind.replace(' ', '_')}.log", env)
    except BaseException:
        stop_all(servers)
        raise
    return servers


def stop_all(servers: dict[str, Server]) -> None:
    for server in servers.values():
        server.stop()


def run(model: Path, work: Path, lengths: list[int], reps: int, env: dict) -> dict:
    """Both servers up at once, each request sent to one and then the other (the same machine
    state for both), one request at a time."""
    out = {kind: {n: {case: [] for case in CASES} for n in lengths} for kind in SERVERS}
    questions = {"first": "What is a KV cache?", "repeat": "What is a KV cache?"}
    servers = start_all(model, work, env)
    try:
        for n in lengths:
            for rep in range(reps):
                system = system_prompt(n, rep)
                for case in ("first", "repeat", "shared"):
                    question = questions.get(case, f"Question {rep}: why reuse a prefix?")
                    for kind, server in servers.items():
                        out[kind][n][case].append(first_token(server, system, question))
                C.log(f"[serve] {n} tokens rep {rep + 1}/{reps}: " + "; ".join(
                    f"{kind} " + ", ".join(f"{c} {out[kind][n][c][-1][0] * 1e3:.0f} ms" for c in ("first", "repeat", "shared"))
                    for kind in servers))
    finally:
        stop_all(servers)
    servers = start_all(model, work, env)  # the same store: what kvstore wrote before is on disk
    try:
        for n in lengths:
            for rep in range(reps):
                for kind, server in servers.items():
                    out[kind][n]["restart"].append(first_token(server, system_prompt(n, rep), questions["first"]))
            C.log(f"[serve] {n} tokens after a restart: " + "; ".join(
                f"{kind} " + ", ".join(f"{t * 1e3:.0f} ms" for t, _ in out[kind][n]["restart"]) for kind in servers))
    finally:
        stop_all(servers)
    return {kind: {str(n): {case: {"median_s": statistics.median(t for t, _ in v), "samples_s": [t for t, _ in v],
                                   "cached_tokens": [c for _, c in v]}
                            for case, v in cases.items()} for n, cases in per.items()}
            for kind, per in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one short length, two reps")
    ap.add_argument("--tokens", type=C.positive_int, nargs="*", default=None, help="system prompt lengths (default 2048 8192)")
    ap.add_argument("--reps", type=C.positive_int, default=None)
    ap.add_argument("--out", type=Path, help="write the JSON here instead of bench/results/serve.json")
    args = ap.parse_args()
    lengths = args.tokens or ([1024] if args.quick else [2048, 8192])
    reps = args.reps or (2 if args.quick else 3)
    model = ensure_demo_model()
    env = dict(os.environ, PYTHONPATH=str(C.REPO))
    blas = C.openblas_path()
    if blas and blas not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = blas
    started = time.perf_counter()
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(dir=C.scratch_root()) as tmp:
        results = run(model, Path(tmp), lengths, reps, env)
    data = {"model": str(model), "lengths": lengths, "reps": reps, "quick": args.quick,
            "blas": "OpenBLAS (Debian libopenblas0-pthread, LD_PRELOAD)" if "LD_PRELOAD" in env and blas
            else "reference BLAS bundled with the mlx-cpu wheel",
            "results": results, "started": time.strftime("%Y-%m-%d %H:%M %Z"), "seconds": time.perf_counter() - started,
            "load_average_start": load_start, "load_average_end": os.getloadavg()[0], "machine": C.machine()}
    if args.out:
        args.out.write_text(json.dumps(data, indent=2, default=str) + "\n")
        path = args.out
    else:
        path = C.write_result("serve", data)
    for n in lengths:
        for case in CASES:
            stock, ours = (results[k][str(n)][case] for k in SERVERS)
            C.log(f"[serve] {n} tokens, {case}: mlx_lm.server {stock['median_s'] * 1e3:.0f} ms "
                  f"(cached {stock['cached_tokens']}), kvstore serve {ours['median_s'] * 1e3:.0f} ms "
                  f"(cached {ours['cached_tokens']}): kvstore {stock['median_s'] / ours['median_s']:.2f}x as fast")
    m = data["machine"]
    C.log(f"[serve] medians of time to first token; {m['cpu']}, {m['cores']} cores, BLAS in the servers: "
          f"{data['blas']}; load average {load_start:.2f} -> {data['load_average_end']:.2f}")
    C.log(f"[serve] {path}")


if __name__ == "__main__":
    main()
