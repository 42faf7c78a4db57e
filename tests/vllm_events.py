"""A KV event consumer written from vLLM's schema (vllm/distributed/kv_events.py), not from
kvstore's encoder: msgspec structs as vLLM declares them, a SUB socket that binds (as llm-d's
router does, the publisher connects to it) and reads on a thread of its own, and the replay
DEALER. `Consumer.view()` is what a router that follows the events believes a node holds."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Union

import msgspec
import zmq

# -- vLLM's structs: events as maps tagged by "type" (vLLM since mid-2026) ----------------------

class MapEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class BlockStored(MapEvent):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None
    kv_cache_spec_sliding_window: Union[int, None] = None


class BlockRemoved(MapEvent):
    block_hashes: list[int]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class AllBlocksCleared(MapEvent):
    pass


class MapBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


# -- the same, as positional arrays (vLLM before mid-2026) ------------------------------------

class ArrayEvent(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class LegacyBlockStored(ArrayEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: Union[int, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Union[tuple[Any, ...], None]], None] = None


class LegacyBlockRemoved(ArrayEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: Union[str, None]


class LegacyAllBlocksCleared(ArrayEvent, tag="AllBlocksCleared"):
    pass


class LegacyBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[LegacyBlockStored, LegacyBlockRemoved, LegacyAllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


DECODERS = {"map": msgspec.msgpack.Decoder(MapBatch), "legacy": msgspec.msgpack.Decoder(LegacyBatch)}


def kind(event) -> str:
    return type(event).__name__.removeprefix("Legacy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Consumer:
    """Binds a SUB socket on 127.0.0.1 (`endpoint`) and keeps every batch it gets, by sequence
    number; `replay_endpoint` is for the publisher's replay ROUTER (bound by it)."""

    def __init__(self, encoding: str = "map"):
        self.encoding = encoding
        self.decoder = DECODERS[encoding]
        self.port, self.replay_port = free_port(), free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{self.replay_port}"
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.bind(self.endpoint)
        self.live: dict[int, Any] = {}
        self.arrivals: list[tuple[int, Any]] = []  # (number, batch) in the order they came
        self.raw: dict[int, bytes] = {}  # number -> the payload as it came
        self.topics: set[bytes] = set()
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def config(self, **extra) -> dict:
        return {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                "replay_endpoint": self.replay_endpoint, **extra}

    def _read(self) -> None:
        while not self._stop:
            if self.sub.poll(50):
                topic, seq, payload = self.sub.recv_multipart()
                with self._lock:
                    self.topics.add(topic)
                    batch = self.decoder.decode(payload)
                    self.live[int.from_bytes(seq, "big")] = batch
                    self.raw[int.from_bytes(seq, "big")] = payload
                    self.arrivals.append((int.from_bytes(seq, "big"), batch))

    def first_arrival(self, timeout: float = 10.0) -> tuple[int, Any]:
        """The first batch the live socket got since `arrivals` was last cleared."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if self.arrivals:
                    return self.arrivals[0]
            time.sleep(0.01)
        raise AssertionError(f"no batch came on the live socket within {timeout} s")

    def replay(self, start: int) -> list[tuple[int, Any]]:
        """Every batch the publisher kept from `start` on, then the end marker (checked)."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(10_000), "no answer from the replay socket"
                empty, seq, payload = dealer.recv_multipart()
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    assert payload == b""
                    return out
                out.append((n, self.decoder.decode(payload)))
        finally:
            dealer.close()

    def batches(self, upto: int, timeout: float = 10.0) -> list[tuple[int, Any]]:
        """Batches 0 to `upto - 1` in sequence order, without a gap: what the live socket has not
        got within `timeout` (the first ones, sent before it was connected) is asked of the
        replay socket."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                got = {n: b for n, b in self.live.items() if n < upto}
            missing = [n for n in range(upto) if n not in got]
            if missing and (time.monotonic() > deadline or missing[0] < min(got, default=upto)):
                for n, batch in self.replay(missing[0]):
                    if n < upto:
                        got.setdefault(n, batch)
                missing = [n for n in range(upto) if n not in got]
            if not missing:
                return sorted(got.items())
            assert time.monotonic() < deadline + timeout, f"batches {missing[:5]}... never came"
            time.sleep(0.02)

    def view(self, batches) -> dict[str, dict[int, tuple[int | None, list[int]]]]:
        """medium -> block hash -> (parent block hash, token ids): what a router that applies
        every event in order believes the node holds."""
        held: dict[str, dict[int, tuple[int | None, list[int]]]] = {}
        for _, batch in batches:
            for e in batch.events:
                if kind(e) == "AllBlocksCleared":
                    held.clear()
                elif kind(e) == "BlockStored":
                    blocks = held.setdefault(e.medium, {})
                    parent = e.parent_block_hash
                    for i, h in enumerate(e.block_hashes):
                        blocks[h] = (parent, e.token_ids[i * e.block_size : (i + 1) * e.block_size])
                        parent = h
                else:
                    for h in e.block_hashes:
                        held.get(e.medium, {}).pop(h, None)
        return held

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sub.close(linger=0)
        self.ctx.term()


def chained_tokens(blocks: dict[int, tuple[int | None, list[int]]], last: int) -> list[int]:
    """The token ids from the first block to block `last`, following `parent_block_hash`."""
    out: list[int] = []
    h: int | None = last
    seen = set()
    while h is not None:
        assert h not in seen, "a cycle of parent_block_hash"
        seen.add(h)
        parent, tokens = blocks[h]
        out = tokens + out
        h = parent
    return out


def expected_blocks(tokens: list[int], block_size: int, chunk_size: int) -> int:
    """How many blocks a prompt of `tokens` is announced as: every full block (a chunk's, and a
    tail's full ones)."""
    return len(tokens) // block_size
