"""vLLM's KV events on the wire: msgpack batches of `BlockStored`, `BlockRemoved` and
`AllBlocksCleared`.

A batch is `[ts, events, data_parallel_rank]`. Each event is a map tagged by `"type"` (vLLM since
mid-2026) or, with `encoding="legacy"`, a positional array whose first item is the tag (vLLM
before). Block hashes are unsigned 64-bit ints.

- Maps carry what current vLLM sends: `BlockStored` has `block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name`, `extra_keys` (one entry per block: None,
  or a tenant's tag on its first block), `group_idx` (0: kvstore announces one group) and
  `kv_cache_spec_kind` ("full_attention", whatever the model's layers are: a block announced
  means the node restores the whole prefix up to its end, every layer's state included, which
  is what a router assumes of a full-attention group); `BlockRemoved` has `block_hashes,
  medium, group_idx`.
- Arrays are as vLLM sent them before: `BlockStored` is `block_hashes, parent_block_hash,
  token_ids, block_size, lora_id, medium, lora_name` and, only when a block is tagged,
  `extra_keys`; `BlockRemoved` is `block_hashes, medium`.
- `AllBlocksCleared` has no field.
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
#: The one KV cache group kvstore announces, and its kind (see the module docstring).
GROUP_IDX = 0
SPEC_KIND = "full_attention"
#: Fields only the map encoding has.
MAP_ONLY = ("group_idx", "kv_cache_spec_kind")


def stored(block_hashes: list[int], parent: int | None, token_ids: list[int], block_size: int, medium: str,
           extra_keys: list | None = None) -> dict[str, Any]:
    """`extra_keys`: one entry per block (None: no block is tagged)."""
    return {"type": "BlockStored", "block_hashes": block_hashes, "parent_block_hash": parent,
            "token_ids": token_ids, "block_size": block_size, "lora_id": None, "medium": medium,
            "lora_name": None, "extra_keys": extra_keys or [None] * len(block_hashes),
            "group_idx": GROUP_IDX, "kv_cache_spec_kind": SPEC_KIND}


def removed(block_hashes: list[int], medium: str) -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": block_hashes, "medium": medium, "group_idx": GROUP_IDX}


def cleared() -> dict[str, Any]:
    return {"type": "AllBlocksCleared"}


def _positional(event: dict[str, Any]) -> list:
    """An event as vLLM's positional array (its trailing optional `extra_keys` only when a block
    is tagged)."""
    untagged = not any(k is not None for k in event.get("extra_keys", ()))
    return [event["type"], *(v for k, v in event.items()
                             if k != "type" and k not in MAP_ONLY and not (k == "extra_keys" and untagged))]


def encode(events: list[dict[str, Any]], encoding: str = "map", ts: float | None = None) -> bytes:
    """One batch, as msgpack: `[ts, events, data_parallel_rank]`."""
    items = events if encoding == "map" else [_positional(e) for e in events]
    return msgpack.packb([time.time() if ts is None else ts, items, DATA_PARALLEL_RANK], use_bin_type=True)
