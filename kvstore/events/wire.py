"""vLLM's KV events on the wire: msgpack batches of `BlockStored`, `BlockRemoved` and
`AllBlocksCleared`.

A batch is `[ts, events, data_parallel_rank]`. Each event is a map tagged by `"type"` (vLLM since
mid-2026) or, with `encoding="legacy"`, a positional array whose first item is the tag (vLLM
before): `BlockStored` is `block_hashes, parent_block_hash, token_ids, block_size, lora_id,
medium, lora_name` and, when given, `extra_keys` (one entry per block); `BlockRemoved` is
`block_hashes, medium`; `AllBlocksCleared` has no field. Block hashes are unsigned 64-bit ints.
"""

from __future__ import annotations

import time
from typing import Any

import msgpack

#: Where a block is held: the store's memory tier (RAM), or its disk.
MEDIUM_RAM = "CPU_TIER1"
MEDIUM_DISK = "DISK"
#: One node, one rank: kvstore serve is not data parallel.
DATA_PARALLEL_RANK = 0


def stored(block_hashes: list[int], parent: int | None, token_ids: list[int], block_size: int, medium: str,
           extra_keys: list | None = None) -> dict[str, Any]:
    event = {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent,
             "token_ids": token_ids, "block_size": block_size, "lora_id": None, "medium": medium,
             "lora_name": None}
    if extra_keys is not None:
        event["extra_keys"] = extra_keys
    return event


def removed(block_hashes: list[int], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def _positional(event: dict[str, Any]) -> list:
    """An event as vLLM's positional array (its trailing optional `extra_keys` only when given)."""
    return [event["type"], *(v for k, v in event.items() if k != "type")]


def encode(events: list[dict[str, Any]], encoding: str = "map", ts: float | None = None) -> bytes:
    """One batch, as msgpack: `[ts, events, data_parallel_rank]`."""
    items = events if encoding == "map" else [_positional(e) for e in events]
    return msgpack.packb([time.time() if ts is None else ts, items, DATA_PARALLEL_RANK], use_bin_type=True)
