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
canary's check. `replayed` runs the same steps and gives the canaries they make: what an export of
K/V quantized on disk carries, so that an import replays like with like.
"""

from __future__ import annotations

from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Callable, Iterable

import mlx.core as mx
import numpy as np

from kvstore import canary
from kvstore.errors import PackError
from kvstore.packs.manifest import blob_name
from kvstore.records import Span
from kvstore.storage import blobformat
from kvstore.store import MEMORY, Store
from kvstore.tiers.memory import held


@dataclass(frozen=True)
class Kind:
    """How one kind of canary is replayed and checked. `step(value)` gives (at, token): the step
    restores the prompt's first `at` tokens and processes `token` alone; `check(value, logits)`
    (the step's logits, a float32 numpy vector; optionally a tolerance) is None when they agree
    with the canary, else why not, in a few words; `remake(value, logits)` is the field's text of
    the canary those logits give."""

    step: Callable[[object], tuple[int, int]]
    check: Callable[..., str | None]  # (value, logits[, tolerance])
    remake: Callable[[object, np.ndarray], str]  # (value, logits) -> the field's text those logits give


def _check_canary(value: canary.Canary, logits: np.ndarray, tolerance: float = canary.TOLERANCE) -> str | None:
    result = canary.check(value, logits, tolerance)
    return None if result.ok else result.reason


#: canary field (a blob header extension registered with its validator) -> its `Kind`: the
#: prompt's canary (`kvstore.canary`), kept from the first step after a prompt.
CANARIES: dict[str, Kind] = {"canary": Kind(step=lambda c: (c.at, c.token), check=_check_canary,
                                            remake=lambda c, logits: canary.of(c.at, c.token, logits).text())}


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


@contextmanager
def _in_ram(mc, disk_kv_bits: int | None, records: Iterable[tuple[Span, np.ndarray, bytes]]):
    """A store in RAM holding `records` (record, its token ids, its blob), bound as `mc` is."""
    records = list(records)
    size = sum(len(buf) for _, _, buf in records)
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
        yield rc


def _readable(fields: dict[str, str]) -> dict[str, object]:
    """The canary values of these fields that this kvstore reads (a later version's are kept, not read)."""
    values = blobformat.extensions({blobformat.EXTENSION_PREFIX + k: v for k, v in fields.items()})
    return {name: values[name] for name in fields if values.get(name) is not None}


def _steps(mc, disk_kv_bits: int | None, records: Iterable[tuple[Span, np.ndarray, bytes]],
           canaries: list[tuple[Span, np.ndarray, dict[str, str]]]):
    """Each canary record (arguments as `replay`'s) with its fields and, for every canary of them
    this kvstore reads, (name, value, the logits of its replayed step or None where it cannot be
    replayed), from `records` held in a store in RAM."""
    with _in_ram(mc, disk_kv_bits, records) as rc:
        for span, prompt, fields in canaries:
            yield span, prompt, fields, [(name, value, _step(rc, span, prompt, name, value))
                                         for name, value in _readable(fields).items()]


def replay(mc, disk_kv_bits: int | None, records: Iterable[tuple[Span, np.ndarray, bytes]],
           canaries: list[tuple[Span, np.ndarray, dict[str, str]]]) -> tuple[int, int]:
    """Check every canary by one replayed step (see the module docstring): (how many were
    checked, how many could not be replayed from the pack: a model with recurrent layers restores
    only at a checkpoint, and a prompt's canary is of the step before its end checkpoint).
    `records`: (record, its token ids, its blob); `canaries`: (record, the tokens of a prompt it
    is part of, its canary fields). PackError naming the record if one does not hold."""
    checked = unreplayable = 0
    with closing(_steps(mc, disk_kv_bits, records, canaries)) as each:  # the store in RAM goes at once
        for span, prompt, _, steps in each:
            for name, value, logits in steps:
                if logits is None:
                    unreplayable += 1
                    continue
                why = CANARIES[name].check(value, logits)
                if why is not None:
                    raise PackError(f"{_where(span, prompt)}: its {_called(name)} does not hold for the "
                                    f"replayed step ({why})")
                checked += 1
    return checked, unreplayable


def replayed(mc, disk_kv_bits: int | None, records: Iterable[tuple[Span, np.ndarray, bytes]],
             canaries: list[tuple[Span, np.ndarray, dict[str, str]]],
             tolerance: float) -> dict[bytes, dict[str, str]]:
    """The canary fields that one replayed step from `records` gives (arguments as `replay`'s):
    record hash -> its fields, each canary remade from the replayed step's logits (a canary that
    cannot be replayed, or of a later version, is kept as it is). What a pack of K/V quantized on
    disk carries, so that an import's replay compares like with like. PackError naming the record
    if a replayed step moved further than `tolerance` from the canary it replaces (the bound of
    the quantization: more is damage, not rounding)."""
    out = {}
    with closing(_steps(mc, disk_kv_bits, records, canaries)) as each:
        for span, prompt, fields, steps in each:
            fields = dict(fields)
            for name, value, logits in steps:
                if logits is None:
                    continue
                why = CANARIES[name].check(value, logits, tolerance)
                if why is not None:
                    raise PackError(f"{_where(span, prompt)}: its {_called(name)} is not reproduced by a "
                                    f"step replayed from its stored K/V, even within the quantization's bound "
                                    f"{tolerance:g} ({why}): run `kvstore verify --exact`")
                fields[name] = CANARIES[name].remake(value, logits)
            out[span.hash] = fields
    return out


def _where(span: Span, prompt: np.ndarray) -> str:
    """How a message names a canary's record: its blob file and the prompt's tokens it holds."""
    return f"{blob_name(span.hash)} (tokens {span.start}-{span.end} of a prompt of {len(prompt)} tokens)"


def _called(name: str) -> str:
    """How a message names a canary field: the prompt's is "canary"."""
    return "canary" if name == "canary" else f"canary {name!r}"


def _step(mc, span: Span, prompt: np.ndarray, name: str, value) -> np.ndarray | None:
    """The logits (float32, host) of one canary's step of record `span` (of `prompt`), replayed
    from the records in `mc`'s store: None when its state cannot be restored from them (recurrent
    layers with no checkpoint at the step: one from earlier would leave the records after it
    computed again, not checked)."""
    where = f"record {span.hash.hex()}"
    kind = CANARIES.get(name)
    if kind is None:
        raise PackError(f"{where}: its {_called(name)} is not one this kvstore can check: import with "
                        "--no-replay to skip the canaries")
    at, token = kind.step(value)
    if not (span.start <= at <= span.end and 0 <= at <= len(prompt)):
        raise PackError(f"{where}: its {_called(name)} is of the step at token {at}, which is not at this record")
    tokens = np.append(prompt[:at], np.int32(token)).astype(np.int32)
    cache, rest = mc.fetch(tokens)
    if mc.checkpointed and len(rest) > 1:  # restored from an earlier checkpoint: the records after it
        return None                        # would be computed again, not checked
    if len(rest) == len(tokens) and at > 0:  # (at 0, a prompt of one token: its step has nothing before it)
        raise PackError(f"{where}: its {_called(name)} cannot be replayed: none of the {at} tokens before its "
                        "step could be restored from the pack")
    return np.array(mc.model(mx.array([rest]), cache=cache)[0, -1].astype(mx.float32))
