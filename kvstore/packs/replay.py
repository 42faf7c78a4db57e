"""Canaries: a record's small fingerprint of the logits of one step, checked by replaying that step.

A canary is a field of a blob's header, stored through the header's extension point
(`storage.blobformat.register_extension`: `x-<name>` in the metadata, with a validator that
parses it). `CANARIES` names the fields that are canaries, with their `Kind`: which step a canary
is of (the prompt's first `at` tokens restored, then `token` processed alone) and how it is
checked against the logits of that step.

`replay` checks a pack's canaries before anything is stored: it puts the pack's records into a
store of its own in RAM (`kvstore.MEMORY`), restores the first `at` tokens of the canary's prompt
through the ordinary fetch (a model with recurrent layers restores from the last checkpoint
before them and computes the few tokens after it), runs `token`, and hands the logits to the
canary's check.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import mlx.core as mx
import numpy as np

from kvstore import canary
from kvstore.errors import PackError
from kvstore.records import Span
from kvstore.storage import blobformat
from kvstore.store import MEMORY, Store
from kvstore.tiers.memory import held


@dataclass(frozen=True)
class Kind:
    """How one kind of canary is replayed and checked. `step(value)` gives (at, token): the step
    restores the prompt's first `at` tokens and processes `token` alone; `check(value, logits)`
    (the step's logits, a float32 numpy vector) is None when they agree with the canary, else why
    not, in a few words."""

    step: Callable[[object], tuple[int, int]]
    check: Callable[[object, np.ndarray], str | None]


def _check_canary(value: canary.Canary, logits: np.ndarray) -> str | None:
    result = canary.check(value, logits)
    return None if result.ok else result.reason


#: canary field (a blob header extension registered with its validator) -> its `Kind`: the
#: prompt's canary (`kvstore.canary`), kept from the first step after a prompt.
CANARIES: dict[str, Kind] = {"canary": Kind(step=lambda c: (c.at, c.token), check=_check_canary)}


def canary_fields(metadata: dict[str, str]) -> dict[str, str]:
    """The canary fields of a blob header, as their text (each checked by its validator)."""
    values = blobformat.extensions(metadata)
    return {name: metadata[blobformat.EXTENSION_PREFIX + name] for name in CANARIES if name in values}


def record_arrays(buf) -> tuple[dict[str, mx.array], dict[str, mx.Dtype]]:
    """A record blob's tensors as mlx arrays (bfloat16 carried as its bits, named in the views)."""
    entries, base, _ = blobformat.parse(buf)
    arrays, views = {}, {}
    for name, info in entries.items():
        if name == "tokens":
            continue
        dtype = blobformat.DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        flat = np.frombuffer(buf, dtype=dtype, count=(end - start) // dtype.itemsize, offset=base + start)
        arrays[name] = mx.array(flat.reshape(info["shape"]))
        if info["dtype"] == "BF16":
            views[name] = mx.bfloat16
    return arrays, views


def replay(mc, disk_kv_bits: int | None, records: Iterable[tuple[Span, np.ndarray, bytes]],
           canaries: list[tuple[Span, np.ndarray, dict[str, str]]]) -> tuple[int, int]:
    """Check every canary by one replayed step (see the module docstring): (how many were
    checked, how many could not be replayed from the pack: a model with recurrent layers restores
    only at a checkpoint, and a prompt's canary is of the step before its end checkpoint).
    `records`: (record, its token ids, its blob); `canaries`: (record, the tokens of a prompt it
    is part of, its canary fields). PackError naming the record if one does not hold."""
    records = list(records)
    size = sum(len(buf) for _, _, buf in records)
    checked = unreplayable = 0
    with Store(MEMORY, memory_bytes=2 * size + (64 << 20), chunk_size=mc.chunk_size,
               disk_kv_bits=disk_kv_bits, exact_prefill=mc.exact) as ram:
        rc = ram.bind(mc.model, mc.model_id, fingerprint=mc.fingerprint, kv_bits=mc.kv_bits,
                      kv_group_size=mc.kv_group_size)
        if rc.ns != mc.ns:
            raise PackError("the canaries cannot be replayed: a store in RAM gives this model another namespace")
        kept = []
        for span, tokens, buf in records:
            arrays, views = record_arrays(buf)
            kept.append(held(span, np.array(tokens), arrays, views))
        ram.memory.put(reversed(kept))
        for span, prompt, fields in canaries:
            values = blobformat.extensions({blobformat.EXTENSION_PREFIX + k: v for k, v in fields.items()})
            for name in fields:
                if values.get(name) is None:  # a canary of a later version: kept, not read
                    continue
                if _replay_one(rc, span, prompt, name, values.get(name)):
                    checked += 1
                else:
                    unreplayable += 1
    return checked, unreplayable


def _replay_one(mc, span: Span, prompt: np.ndarray, name: str, value) -> bool:
    """Replay the step of one canary of record `span` (of `prompt`) from the pack's records: True
    once it held, False when the step's state cannot be restored from the pack (recurrent layers
    with no checkpoint before it: nothing of the pack would be checked by it)."""
    where = f"record {span.hash.hex()}"
    kind = CANARIES.get(name)
    if kind is None:
        raise PackError(f"{where}: its canary {name} is not one this kvstore can check: import with "
                        "--no-replay to skip the canaries")
    at, token = kind.step(value)
    if not (span.start <= at <= span.end and 0 < at <= len(prompt)):
        raise PackError(f"{where}: its canary {name} is of the step at token {at}, which is not at this record")
    tokens = np.append(prompt[:at], np.int32(token)).astype(np.int32)
    cache, rest = mc.fetch(tokens)
    if len(rest) == len(tokens):
        if mc.checkpointed:
            return False
        raise PackError(f"{where}: its canary cannot be replayed: none of the {at} tokens before its step "
                        "could be restored from the pack")
    logits = mc.model(mx.array([rest]), cache=cache)[0, -1].astype(mx.float32)
    why = kind.check(value, np.array(logits))
    if why is not None:
        raise PackError(f"{where}: its canary {name} does not hold for the replayed step ({why})")
    return True
