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

# -- what the strictest consumers also require of a batch ----------------------------------
# Dynamo's kv router (lib/kv-router/src/zmq_wire.rs) reads the batch as a 3-tuple (f64, events,
# Option<i32>) and drops a store event whose hashes (with its parent's) repeat, or whose token
# ids are fewer than block_size per hash; llm-d's kv-cache (engineadapter/vllm_adapter.go) reads
# a map event by putting its fields in vLLM's positional order, token ids as uint32, hashes as
# uint64, `medium` and `lora_name` as strings or nil.
STORED_ORDER = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")
REMOVED_ORDER = ("block_hashes", "medium", "group_idx")


def strict_problems(payload: bytes, encoding: str) -> list[str]:
    """What in one batch the strictest consumers would refuse or misread (nothing: [])."""
    batch = msgspec.msgpack.decode(payload)
    if not (isinstance(batch, list) and len(batch) == 3 and type(batch[0]) is float and type(batch[2]) is int):
        return [f"the batch is not [float ts, events, int rank]: {batch!r:.200}"]
    out = []
    for e in batch[1]:
        if encoding == "map":
            if not isinstance(e, dict):
                out.append(f"a map-encoded event is a {type(e).__name__}")
                continue
            order = {"BlockStored": STORED_ORDER, "BlockRemoved": REMOVED_ORDER}.get(e.get("type"), ())
            fields = [e.get("type"), *(e.get(k) for k in order)]
        else:
            fields = e
        if fields[0] == "BlockStored":
            hashes, parent, tokens, size, _, medium, lora_name = fields[1:8]
            if not all(type(h) is int and 0 <= h < 2**64 for h in [*hashes, *([parent] if parent is not None else [])]):
                out.append("a block hash is not an unsigned 64-bit int")
            if len({*hashes, parent} - {None}) != len(hashes) + (parent is not None):
                out.append("a store event repeats a block hash (Dynamo drops it)")
            if not all(type(t) is int and 0 <= t < 2**32 for t in tokens):
                out.append("a token id is not an unsigned 32-bit int")
            if type(size) is not int or len(tokens) != size * len(hashes):
                out.append(f"{len(tokens)} token ids for {len(hashes)} blocks of {size}")
            if not isinstance(medium, str) or lora_name is not None:
                out.append(f"medium {medium!r}, lora_name {lora_name!r}")
        elif fields[0] == "BlockRemoved":
            if not all(type(h) is int and 0 <= h < 2**64 for h in fields[1]) or not isinstance(fields[2], str):
                out.append(f"a removal is not [hashes as uint64, medium]: {fields!r:.200}")
        elif fields[0] != "AllBlocksCleared":
            out.append(f"an event tagged {fields[0]!r}")
    return out


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
        self.problems: list[str] = []  # what the strictest consumers would refuse (strict_problems)
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
                    self.problems += strict_problems(payload, self.encoding)
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
        """Every batch the publisher kept from `start` on, then the end marker (checked), in
        vLLM's layout: after the delimiter `(topic, seq, payload)`, the end `(b"", -1, b"")`
        (vLLM since its map-encoded events, vllm/distributed/kv_events.py `_service_replay`);
        with the legacy encoding, as before: `(seq, payload)`, the end `(-1, b"")`."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                assert dealer.poll(10_000), "no answer from the replay socket"
                frames = dealer.recv_multipart()
                if self.encoding == "map":
                    assert len(frames) == 4, f"{len(frames)} frames, not (empty, topic, seq, payload)"
                    empty, topic, seq, payload = frames
                else:
                    assert len(frames) == 3, f"{len(frames)} frames, not (empty, seq, payload)"
                    (empty, seq, payload), topic = frames, None
                assert empty == b"" and len(seq) == 8
                n = int.from_bytes(seq, "big", signed=True)
                if n == -1:
                    assert payload == b"" and topic in (b"", None)
                    return out
                with self._lock:
                    assert topic is None or not self.topics or topic in self.topics, \
                        f"replayed topic {topic!r}, live {self.topics}"
                assert not strict_problems(payload, self.encoding), strict_problems(payload, self.encoding)
                out.append((n, self.decoder.decode(payload)))
        finally:
            dealer.close()

    def batches(self, upto: int, timeout: float = 10.0) -> list[tuple[int, Any]]:
        """Batches 0 to `upto - 1` in sequence order, without a gap: what the live socket has not
        got within `timeout` (the first ones, sent before it was connected) is asked of the
        replay socket. Every batch the live socket got must pass `strict_problems`."""
        with self._lock:
            assert not self.problems, self.problems[:5]
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
