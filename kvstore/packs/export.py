"""Exporting prompts from a store as a pack (see `packs.manifest` for what a pack is).

Each prompt is stored first where it is not (`ModelCache.prefill`, written whatever the
admission policy says), then its records are read back from disk, checked, and written to the
pack without the exporter's `model_id` (a local path). Every blob holds its token ids: a pack
carries its prompts in clear. Only the shared namespace is exported: a record a tenant wrote
never leaves the store in a pack (`shared_only`).

The pack is written into a temporary folder beside `out` and renamed to it once whole (signed,
when a key is given), so an export that fails or is stopped leaves no partial pack.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from kvstore import canary, keys
from kvstore.errors import BlobError, PackError, WrongKeyError
from kvstore.packs import identity, replay, signing
from kvstore.packs.manifest import BLOBS, MANIFEST, Manifest, Prompt, blob_name, sha256
from kvstore.packs.replay import canary_fields
from kvstore.packs.verify import acting_disk_kv_bits, is_free, settle, with_checkpoints
from kvstore.records import checkpoint_of, prompt_records
from kvstore.storage import blobformat
from kvstore.upkeep.verify import checked_record


@dataclass
class Exported:
    """What an export wrote: prompts, their tokens (how many had to be computed first, and how
    many were stored before the export: the rest were shared with an earlier prompt of it),
    records and bytes in the pack, whether it is signed, and how many prompts it carries as the
    start of a longer one of them."""

    prompts: int
    tokens: int
    computed: int
    records: int
    bytes: int
    signed: bool
    stored_before: int = 0
    within_another: int = 0  # prompts carried as the start of a longer prompt of the pack
    repeats: int = 0  # prompts given again (the same tokens as an earlier one): carried once, counted once
    pin_asked: int = 0  # distinct prompts whose lines say "pin": true
    pinned: int = 0  # of those, the ones whose records the store holds pinned after the export
    unpinned: int = 0  # records unpinned for lines that say "pin": false


def shared_only(rows: Sequence) -> None:
    """Refuse records of a tenant: only the shared namespace is exportable. A row that carries a
    tenant's tag (`tenant`, None for the shared namespace) is a tenant's."""
    theirs = [r for r in rows if getattr(r, "tenant", None) is not None]
    if theirs:
        raise PackError(f"{len(theirs)} of the prompts' records belong to a tenant: only the shared "
                        "namespace (warmed and pinned prompts of a store bound without a tenant) is exportable")


def check_prompts(mc, prompts: Sequence) -> None:
    """PackError for a binding or a prompt the pack could not carry: a tenant's binding (only the
    shared namespace is exportable); in exact mode, a prompt of a single token (a prompt's last
    token is the first generation step's, never stored: there is nothing of it)."""
    if getattr(mc, "tenant", None) is not None:
        raise PackError("the model is bound for a tenant: only the shared namespace is exportable (bind it "
                        "without a tenant, as `kvstore pack export` does)")
    single = next((i for i, t in enumerate(prompts, 1) if mc.exact and len(t) < 2), None)
    if single is not None:
        raise PackError(f"prompt {single} of the pack is a single token: in exact mode a prompt's last token is "
                        "the first generation step's and is never stored, so there is nothing of it to carry; "
                        "nothing exported")


def export_pack(store, mc, model_dir: Path, tokenizer, prompts: list[np.ndarray], out: Path, *,
                sign_key: Path | None = None, progress: Callable[[int], None] | None = None,
                pins: Sequence[bool | None] | None = None) -> Exported:
    """Write the pack of `prompts` (token id arrays) of the model bound as `mc` to the folder
    `out` (which must not exist, or be empty), signed with `sign_key` (an EC private key in PEM)
    when given. `pins`: each prompt's "pin" (True: pinned in the store, as `warm` pins it; False:
    unpinned; None: left as it is). PackError if it cannot."""
    said, out = out, Path(os.path.abspath(out))  # (`.` names no folder to make the pack under, nor beside it)
    if not is_free(out):
        raise PackError(f"{said} exists and is not an empty folder: a pack is written to a new folder")
    if store.disk is None:
        raise PackError("a pack is exported from a store directory (not a RAM-only store)")
    if sign_key is not None:
        signing.check_private_key(sign_key)
    check_prompts(mc, prompts)
    pins = _pins_of(prompts, pins)  # (one a distinct prompt)
    repeats = len(prompts) - len(pins)
    ident = identity.identity(Path(model_dir), tokenizer, identity.memo_of(store, remember=not store.read_only))
    prompts = distinct(prompts)
    before = sum(min(mc.stored_length(t), len(mc.stored_part(np.asarray(t)))) for t in prompts)
    computed, pinned, unpinned = _stored_first(store, mc, prompts, pins, progress)
    # What `prefill` stores of each prompt: all of it, or in exact mode all but its last token.
    given = [mc.stored_part(np.asarray(t)) for t in prompts]
    # (A model with recurrent layers restores such a prompt whole only from its own end checkpoint.)
    prompts = _not_within_another(given, lambda t: mc.checkpointed and _held(store, mc, t))
    chains = [prompt_records(mc.ns, t, mc.chunk_size, checkpoint=mc.checkpointed) for t in prompts]
    wanted = list(dict.fromkeys(s.hash for chain in chains for s in chain))
    rows = store.index.rows_of(wanted)
    missing = [h for h in wanted if h not in rows]
    within = [i for i, (t, chain) in enumerate(zip(prompts, chains), 1)
              if any(s.hash not in rows for s in chain) and mc.stored_length(t) >= len(t)]
    if within:
        raise PackError(f"prompt {within[0]} of the pack is stored only as the start of a longer stored "
                        "prompt (its own last record was folded into that prompt's, e.g. the prompt and an "
                        "answer generated after it): export it from a store where it is warmed alone (`kvstore "
                        "pack export --store NEW ...` warms it there first), or export the longer prompt, whose "
                        "pack restores this one too; nothing exported")
    if missing:
        raise PackError(f"{len(missing)} of the prompts' {len(wanted)} records did not reach the disk (a full "
                        "disk, or a write that failed: see `kvstore stats`): nothing exported")
    chains, resumes = _restore_points(store, mc, prompts, chains)
    wanted = list(dict.fromkeys(s.hash for chain, more in zip(chains, resumes) for s in chain + more))
    rows = store.index.rows_of(wanted)
    shared_only(list(rows.values()))
    # Made under its own name (the signature names the folder) in a temporary folder beside `out`.
    staging = out.parent / f".{out.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
    tmp, writing = staging / out.name, _writing(said, out)
    try:
        with writing:
            (tmp / BLOBS).mkdir(parents=True)
        records, canaries, held = {}, {}, {}
        bits = acting_disk_kv_bits(mc.layout, store.disk_kv_bits)
        for h in wanted:
            data, tokens, fields = _portable_blob(store, rows[h], mc.chunk_size)
            records[h.hex()] = _write(tmp / blob_name(h), data, writing)
            if fields:
                canaries[h.hex()] = fields
            if bits:  # kept for the replay below (it holds every record of the pack in RAM anyway)
                held[h.hex()] = (tokens, data)
        if bits and canaries:
            _replayed_canaries(mc, bits, tmp, prompts, [c + m for c, m in zip(chains, resumes)], held, records,
                               canaries, writing)
        manifest = Manifest(
            record_format=keys.FORMAT_VERSION, fingerprint=mc.fingerprint.hex(), files=ident.files,
            tokenizer=ident.tokenizer, chat_template=ident.chat_template, namespace=mc.ns.hex(),
            layout=mc.layout, chunk_size=mc.chunk_size, disk_kv_bits=bits,
            prompts=tuple(Prompt(len(t), sha256(keys.token_bytes(t)), tuple(s.hash.hex() for s in chain),
                                 tuple(s.hash.hex() for s in more)) for t, chain, more in zip(prompts, chains, resumes)),
            records=records, canaries=canaries)
        with writing:
            (tmp / MANIFEST).write_bytes(manifest.to_json())
            if sign_key is not None:
                signing.sign(tmp, sign_key)
            settle(tmp, out)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return Exported(len(given), sum(map(len, given)), computed, len(records),
                    sum(n for n, _ in records.values()), sign_key is not None,
                    min(before, sum(map(len, given)) - computed), len(given) - len(prompts), repeats,
                    pins.count(True), pinned, unpinned)


def _pins_of(prompts: list, pins: Sequence[bool | None] | None) -> list[bool | None]:
    """The "pin" of each of `distinct(prompts)`: True if a line of it says true, else False if
    one says false, else None."""
    merged: dict[bytes, bool | None] = {}
    for t, pin in zip(prompts, [None] * len(prompts) if pins is None else pins, strict=True):
        key = np.asarray(t, dtype=np.int64).tobytes()
        was = merged.get(key)
        merged[key] = True if True in (was, pin) else (False if False in (was, pin) else None)
    return list(merged.values())


def _stored_first(store, mc, prompts: list[np.ndarray], pins: list[bool | None],
                  progress: Callable[[int], None] | None) -> tuple[int, int, int]:
    """Store each prompt where it is not (as `warm` does, written whatever admission says), pinned
    or unpinned as its line says, and wait for the writes; (the tokens of the pack's records
    computed for it (in exact mode the last token is a step of its own that is not stored: not
    one of them), the prompts asked to be pinned whose records the store now holds pinned, the
    records unpinned)."""
    computed = unpinned = 0
    for tokens, pin in zip(prompts, pins):
        n = mc.prefill(tokens, progress=progress, pin=bool(pin))[2]
        computed += n - 1 if mc.exact and n and len(tokens) > 1 else n
        if pin is False:
            unpinned += mc.unpin(tokens)["records"]
    store.flush()
    pinned = sum(_held(store, mc, mc.stored_part(np.asarray(t)), pinned=True) for t, pin in zip(prompts, pins) if pin)
    return computed, pinned, unpinned


def distinct(prompts: list) -> list:
    """`prompts` without the repeats of an earlier one (in their order)."""
    seen: set[bytes] = set()
    out = []
    for t in prompts:
        key = np.asarray(t, dtype=np.int64).tobytes()
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def _not_within_another(prompts: list[np.ndarray], own: Callable[[np.ndarray], bool]) -> list[np.ndarray]:
    """The prompts that are not the start of another one of them (nor a repeat of an earlier one),
    or are and `own` says to carry them on their own: the store keeps such a prompt within the
    longer one's records (its own last record folded into the longer prompt's), and the longer
    prompt's pack restores it too, but a model with recurrent layers restores it whole only from
    the checkpoint at its own end."""
    kept = []
    for i, t in enumerate(prompts):
        inside = any((len(u) > len(t) or (len(u) == len(t) and j < i)) and np.array_equal(u[: len(t)], t)
                     for j, u in enumerate(prompts) if j != i)
        if not inside or (not any(np.array_equal(u, t) for u in prompts[:i]) and own(t)):
            kept.append(t)
    return kept


def _restore_points(store, mc, prompts: list[np.ndarray], chains: list[list]) -> tuple[list[list], list[list]]:
    """Each prompt's chain with the shared checkpoints within it that the store holds (a model
    with recurrent layers: a restore point each), and its records at its last token but one
    (`_resume`)."""
    if mc.checkpointed:
        chains = [with_checkpoints(chain, {h for h, r in store.index.rows_of([checkpoint_of(s).hash for s in chain]).items()
                                           if getattr(r, "tenant", None) is None}) for chain in chains]
    return chains, [_resume(store, mc, t, chain) for t, chain in zip(prompts, chains)]


def _resume(store, mc, tokens: np.ndarray, chain: list) -> list:
    """The records of `tokens` at its last token but one that are not in its `chain` and that the
    store holds, all of them (shared), or none: `prefill` stores them where a model restores only
    at a checkpoint or a whole window, and the same prompt asked again resumes from them
    (`ModelCache.resume_records`). Without them the importing store would recompute that prompt."""
    have = {s.hash for s in chain}
    more = [s for s in mc.resume_records(np.asarray(tokens)) if s.hash not in have]
    rows = store.index.rows_of([s.hash for s in more]) if more else {}
    held = len(rows) == len(more) and all(getattr(r, "tenant", None) is None for r in rows.values())
    return more if held else []


def _held(store, mc, tokens: np.ndarray, pinned: bool = False) -> bool:
    """Whether the store holds every record of `tokens`, its end checkpoint too (`pinned`: each
    of them pinned)."""
    chain = prompt_records(mc.ns, tokens, mc.chunk_size, checkpoint=mc.checkpointed)
    rows = store.index.rows_of([s.hash for s in chain])
    return len(rows) == len(chain) and (not pinned or all(r.pinned for r in rows.values()))


def _replayed_canaries(mc, bits: int, folder: Path, prompts: list[np.ndarray], chains: list,
                       held: dict[str, tuple[np.ndarray, bytes]], records: dict[str, tuple[int, str]],
                       canaries: dict[str, dict[str, str]], writing: _writing) -> None:
    """Give the pack's records of K/V quantized on disk the canaries their own replay gives.

    A prompt's canary was taken from the step computed at full precision; an import replays it
    from the quantized K/V, which moves the log-probabilities by up to 0.074 at 8 bits on the demo
    model (more than `canary.TOLERANCE`, and a bound wide enough for that would let K/V scaled by
    1.5 through). So the export replays each canary's step from the pack's blobs (`held`: record
    -> its token ids and the bytes written), exactly as an import does, and the pack carries that
    step's canary: an import compares like with like, by the same tolerance as a pack at full
    precision. The replay must stay within the quantization's bound of the canary it replaces
    (`canary.QUANTIZED_TOLERANCE`): more is damage. The canaries' blobs and `records`/`canaries`
    are rewritten in place."""
    spans = {s.hash.hex(): (s, t) for t, chain in zip(prompts, chains) for s in chain}
    kept = [(spans[h][0], tokens, data) for h, (tokens, data) in held.items()]
    remade = replay.replayed(mc, bits, kept, [(spans[h][0], spans[h][1], f) for h, f in canaries.items()],
                             canary.QUANTIZED_TOLERANCE[bits])
    for h in list(canaries):
        fields = remade[bytes.fromhex(h)]
        data = held[h][1]
        data = blobformat.restamp(data, blobformat.with_extensions(blobformat.header_metadata(data), fields))
        records[h] = _write(folder / blob_name(h), data, writing)
        canaries[h] = fields


def _portable_blob(store, row, chunk_size: int) -> tuple[bytes, np.ndarray, dict[str, str]]:
    """A stored record's blob as a pack holds it, checked, without `model_id` nor this node's trust
    tag: (its bytes, its token ids, its canary fields). Its trust tag is checked first, as a
    restore checks it: a record changed after it was written is never signed into a pack."""
    anchors = store.disk.anchors
    try:
        buf, _, stored = checked_record(store.blob_root, row, chunk_size, where=f"record {row.hash.hex()}",
                                        trust=anchors.trust if anchors is not None else None,
                                        epoch=anchors.epoch if anchors is not None else 0.0)
        fields = canary_fields(stored.metadata)
    except WrongKeyError as e:  # (a fleet node's record, under another secret than the fleet's)
        raise PackError(f"a stored record's trust tag cannot be checked ({e}): nothing exported") from None
    except BlobError as e:
        raise PackError(f"a stored record is damaged ({e}): run `kvstore verify --repair --store {store.path}`, "
                        "then export again") from None
    return blobformat.restamp(buf, blobformat.portable(stored.metadata)), stored.tokens, fields


class _writing:
    """Around the writes of the pack folder: an OSError (a full disk, a file where a folder should
    be) is a `PackError` that names the pack, not the temporary folder it is made in."""

    def __init__(self, said, out: Path):
        self.said, self.out = said, out

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, e, tb) -> None:
        if isinstance(e, OSError):
            there = next((p for p in (self.out.parent, *self.out.parent.parents) if os.path.lexists(p)), None)
            why = f"{there} is not a folder" if there is not None and not there.is_dir() else e.strerror or e
            raise PackError(f"cannot write the pack {self.said}: {why}; nothing exported") from e


def _write(path: Path, data: bytes, writing: _writing) -> tuple[int, str]:
    """Write a blob of the pack: (its size, its SHA-256)."""
    with writing:
        path.write_bytes(data)
    return len(data), sha256(data)
