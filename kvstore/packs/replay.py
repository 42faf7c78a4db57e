"""Canaries: a record's small fingerprint of the logits that follow it, checked by one replayed step.

A canary is a field of a blob's header, stored through the header's extension point
(`storage.blobformat.register_extension`: `x-<name>` in the metadata). `CANARIES` names the
fields that are canaries and the function that checks one against the logits the model computes:
`check(value, logits) -> None` when they agree, else why not (one line).

`replay` checks a pack's canaries before anything is stored: it puts the pack's records into a
store of its own in RAM (`kvstore.MEMORY`), restores each canary's prompt through the ordinary
fetch (all of it but its last token), runs the model one step on that token and hands the
logits to the canary's check.
"""

from __future__ import annotations

from typing import Callable, Iterable

import mlx.core as mx
import numpy as np

from kvstore.errors import PackError
from kvstore.records import Span
from kvstore.storage import blobformat
from kvstore.store import MEMORY, Store
from kvstore.tiers.memory import held

#: canary field (a registered blob header extension) -> check(value, logits): None, or why not.
CANARIES: dict[str, Callable[[object, mx.array], str | None]] = {}


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
           canaries: list[tuple[Span, np.ndarray, dict[str, str]]]) -> int:
    """Check every canary by one replayed step (see the module docstring); how many were checked.
    `records`: (record, its token ids, its blob); `canaries`: (record, the tokens of a prompt it
    is part of, its canary fields). PackError naming the record if one does not hold."""
    records = list(records)
    size = sum(len(buf) for _, _, buf in records)
    checked = 0
    with Store(MEMORY, memory_bytes=2 * size + (64 << 20), chunk_size=mc.chunk_size,
               disk_kv_bits=disk_kv_bits) as ram:
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
            tokens = prompt[: span.end]
            cache, rest = rc.fetch(tokens)
            where = f"record {span.hash.hex()}"
            if len(rest) != 1:
                raise PackError(f"{where}: its canary cannot be replayed: only {len(tokens) - len(rest)} of "
                                f"the {len(tokens)} tokens before it could be restored from the pack")
            logits = rc.model(mx.array([rest]), cache=cache)[0, -1]
            mx.eval(logits)
            values = blobformat.extensions({blobformat.EXTENSION_PREFIX + k: v for k, v in fields.items()})
            for name in fields:
                if name not in CANARIES:
                    raise PackError(f"{where}: its canary {name} is not one this kvstore can check: import "
                                    "with --no-replay to skip the canaries")
                why = CANARIES[name](values[name], logits)
                if why is not None:
                    raise PackError(f"{where}: its canary {name} does not hold for the replayed step ({why})")
                checked += 1
    return checked
