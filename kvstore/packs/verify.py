"""Everything a pack must be before one byte of it is stored, checked in this order:

1. the signature, against the trusted key (`--trust-key`): it covers `manifest.json` as it is and
   exactly the blobs the manifest lists, with the same SHA-256s; and the folder holds those files
   (and the signature) and nothing else, signed or not;
2. the model: the store's chunk size and `disk_kv_bits` (both named when they differ), the SHA-256
   of every weight and tokenizer file and of the chat template, kvstore's fingerprint, the cache
   layout and the namespace;
3. the chain: each prompt's token ids, read from its blobs, have the manifest's count and SHA-256
   (where they do not, the reason names the first blob whose header names another record than
   the one the manifest puts there: blobs swapped or renamed), and hash to the manifest's chain
   of records, and to its records at the prompt's last token but one (`resume`) where it lists
   any; no blob is a tenant's record (a tenant's records never leave its store);
4. each blob's SHA-256;
5. each record's own checks: every tensor's checksum, its header naming the record it is in the
   chain (`records.check`, the one check every tier uses), and its tensors fitting the model's shapes;
6. the canaries, by one replayed step in RAM (`replay`), unless told not to.

Every blob is read once, into memory, and every check runs on those bytes: what is stored is what
was checked. Nothing here writes. A failure is a `PackError` with a one-line reason.
"""

from __future__ import annotations

import json
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kvstore import keys, tenants
from kvstore.errors import BlobError, PackError
from kvstore.packs import identity, signing
from kvstore.packs.manifest import (
    BLOBS,
    MANIFEST,
    MAX_MANIFEST_BYTES,
    SIGNATURE,
    Manifest,
    Prompt,
    blob_name,
    parse,
    sha256,
)
from kvstore.packs.replay import canary_fields, replay
from kvstore.records import CHUNK, Span, checkpoint_of, prompt_records
from kvstore.remote.objects import check_record
from kvstore.restore.quant import layout_bits
from kvstore.sizes import plural
from kvstore.storage import blobformat
from kvstore.storage.blobformat import EXTENSION_PREFIX, Entry

HASH_THREADS = max(1, min(4, os.cpu_count() or 1))


@dataclass(frozen=True)
class Target:
    """What a pack is checked against: a bound model (`ModelCache`), its folder and tokenizer,
    the store's chunk size and `disk_kv_bits`, and the model's `identity` (hashed here if not given)."""

    mc: object
    model_dir: Path
    tokenizer: object
    disk_kv_bits: int | None
    identity: identity.Identity | None = None


@dataclass
class Checked:
    """A record of the pack, checked: its place in the chain and its blob's bytes."""

    span: Span
    tokens: np.ndarray
    blob: bytes
    metadata: dict[str, str]
    prompt: int = 0  # (the first) prompt whose chain it is in


@dataclass
class Verified:
    manifest: Manifest
    records: list[Checked]  # parents first, each once
    signature: str  # how the signature was checked, in words
    canaries: int  # canaries checked by a replayed step
    tokens: int  # of every prompt
    unreplayable: int = 0  # canaries whose step cannot be restored from the pack (recurrent layers)


def verify(folder: Path, target: Target, *, trust_key: Path | None = None, replay_canaries: bool = True,
           max_bytes: int | None = None) -> Verified:
    """Check the pack in `folder` for `target` (see the module docstring); PackError if it fails.
    `max_bytes`: the most blob bytes it may hold (they are all held in memory while checked)."""
    folder = pack_folder(folder)
    raw = read_file(folder / MANIFEST, MAX_MANIFEST_BYTES)
    signed = None
    if trust_key is not None:
        signed = signing.signed_files(folder, trust_key)
        if signed.get(MANIFEST) != sha256(raw):
            blobs = [n for n in signed if n != MANIFEST]
            absent = [n for n in blobs if not os.path.lexists(folder / n)]
            if blobs and len(absent) == len(blobs):
                # (None of what it signs is here: not an edit of this pack's manifest.)
                raise PackError(f"{SIGNATURE} is the signature of another pack (it covers {plural(len(blobs), 'blob')}, "
                                "none of them in this folder): get the pack and its signature together from its maker")
            if absent:  # (a pack that shares some records with this one: its system prompt's, say)
                raise PackError(f"{SIGNATURE} signs another {MANIFEST} and {len(absent)} of its {plural(len(blobs), 'blob')} "
                                f"are not in this folder ({absent[0]}...): it is the signature of another pack, or "
                                "of this one before it was changed; get the pack and its signature together from its maker")
            more = _not_signed(folder, signed)
            if more:  # (every blob it signs is here, beside others: a pack of some of these prompts)
                raise PackError(f"{SIGNATURE} signs another {MANIFEST}, of {plural(len(blobs), 'blob')}, and this folder "
                                f"holds {len(more)} it does not sign ({more[0]}...): it is the signature of another "
                                "pack, or of this one before it was changed; get the pack and its signature together "
                                "from its maker")
            raise PackError(f"{MANIFEST} was changed after the pack was signed (its SHA-256 is not the signed one)")
        said = f"signed by the trusted key {trust_key}"
    else:
        said = ("signed, but the signature was not checked (no --trust-key)"
                if os.path.lexists(folder / SIGNATURE) else "unsigned: no signature to check")
    m = parse(raw)
    if signed is not None:
        _signature_covers(signed, m)
    check_blobs_folder(folder)
    _nothing_else(folder, m, signed is not None)
    _for_this_model(m, target)
    if max_bytes is not None and m.total_bytes > max_bytes:
        raise PackError(f"the pack's blobs are {m.total_bytes} bytes; an import holds them in memory while it "
                        f"checks them, and at most {max_bytes} bytes fit here")
    blobs = {h: _read_blob(folder, h, n) for h, (n, _) in m.records.items()}
    spans, prompts = _chain(m, blobs, target.mc)
    with ThreadPoolExecutor(HASH_THREADS) as pool:  # hashlib lets go of the GIL: one blob a core
        digests = dict(zip(blobs, pool.map(sha256, blobs.values())))
    for h, (_, digest) in m.records.items():
        if digests[h] != digest:
            raise PackError(f"blob {blob_name(h)} does not match its SHA-256 in the manifest")
    checked = [_record(*spans[h], blobs[h], target.mc) for h in _ordered(m)]
    canaries = _canaries(m, checked, prompts)
    n = skipped = 0
    if canaries and replay_canaries:
        n, skipped = replay(target.mc, target.disk_kv_bits, ((c.span, c.tokens, c.blob) for c in checked),
                            canaries)
    return Verified(m, checked, said, n, sum(p.tokens for p in m.prompts), skipped)


def pack_folder(folder: Path) -> Path:
    """`folder`, if it is a folder; PackError saying there is none otherwise (not that the pack
    lacks its manifest: a mistyped path is not a damaged pack)."""
    folder = Path(folder)
    if not folder.exists():
        raise PackError(f"no pack folder at {folder}")
    if not folder.is_dir():
        raise PackError(f"{folder} is not a folder: a pack is a folder (manifest.json, blobs/, model.sig)")
    return folder


def check_file(path: Path, limit: int, *, exact: bool = False, name: str = "", listed: str = "") -> None:
    """PackError unless the pack's file `path` is a regular file (never a link) of at most `limit`
    bytes (`exact`: of `limit` bytes, the size its manifest gives). Where it is missing, the
    error names it as `name` (its file name by default), followed by `listed`."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise PackError(f"the pack has no {name or path.name} ({path}){listed}") from None
    if not stat.S_ISREG(st.st_mode):
        what = ("a symbolic link (a pack holds its files themselves: copy the pack with its files, not "
                "links to them)" if stat.S_ISLNK(st.st_mode) else "a folder" if stat.S_ISDIR(st.st_mode) else "")
        raise PackError(f"{path} is not a regular file" + (f": it is {what}" if what else ""))
    if st.st_size > limit or (exact and st.st_size != limit):
        raise PackError(f"{path} is {st.st_size} bytes, " + (f"the manifest says {limit}" if exact else
                        f"more than it can be ({limit})"))


def check_blobs_folder(folder: Path) -> None:
    """PackError if the pack's `blobs` is there but is not a folder of its own: a symbolic link
    is refused as a linked file is (`check_file`), not taken for a file the manifest does not list."""
    path = folder / BLOBS
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return  # (each blob it lists is then said missing)
    if stat.S_ISLNK(st.st_mode):
        raise PackError(f"{path} is not a folder: it is a symbolic link (a pack holds its files themselves: copy "
                        "the pack with its files, not links to them)")
    if not stat.S_ISDIR(st.st_mode):
        raise PackError(f"{path} is not a folder: a pack keeps its blobs in a folder {BLOBS}/")


def read_file(path: Path, limit: int) -> bytes:
    """A pack file's bytes: a regular file (never through a link) of at most `limit` bytes."""
    check_file(path, limit)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with open(fd, "rb", buffering=0) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise PackError(f"{path} grew past {limit} bytes while it was read")
    return data


def is_free(path: Path) -> bool:
    """Whether a pack may be written to the folder `path`: there is nothing there, or an empty
    folder. A pack is never merged into what a folder holds (its files and another pack's would
    make one that is neither), so export, pull and push all refuse any other."""
    path = Path(path)
    return not path.exists() or (path.is_dir() and not any(path.iterdir()))


def settle(made: Path, out: Path) -> None:
    """Put the whole pack folder `made` at `out` (not there, or an empty folder: `is_free`): renamed
    to it, or, where the folder is there (the working folder, say, which cannot be replaced), its
    entries moved into it, `manifest.json` last (a reader that finds it finds the rest)."""
    if not out.exists():
        os.rename(made, out)
        return
    for name in sorted(os.listdir(made), key=lambda n: (n == MANIFEST, n)):
        os.rename(made / name, out / name)
    made.rmdir()


def _not_signed(folder: Path, signed: dict[str, str]) -> list[str]:
    """The blob files in `folder` that the signature (`signed`: its files) does not cover, sorted."""
    try:
        names = os.listdir(folder / BLOBS)
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(name for name in (f"{BLOBS}/{n}" for n in names) if name not in signed)


def _signature_covers(signed: dict[str, str], m: Manifest) -> None:
    """The signature names exactly the manifest and its blobs, with the manifest's SHA-256s."""
    listed = m.files_listed()
    extra = sorted(set(signed) - set(listed) - {MANIFEST})
    if extra:
        raise PackError(f"the signature covers files the manifest does not list: {extra[:3]}")
    for name, digest in listed.items():
        if name not in signed:
            raise PackError(f"{name} is not covered by the signature")
        if signed[name] != digest:
            raise PackError(f"{name}: its SHA-256 in the manifest is not the signed one")


def _nothing_else(folder: Path, m: Manifest, signed: bool) -> None:
    """The folder holds the manifest, the blobs it lists, the signature if any, and nothing else
    (as model_signing's own verifier requires: a file no signature covers is not part of what was
    signed, and an importer cannot tell what it is for). PackError naming the first few others."""
    expected = {MANIFEST, SIGNATURE, *m.files_listed()}
    extra: list[str] = []
    count = 0
    pending = [(folder, "")]
    while pending:
        where, prefix = pending.pop()
        with os.scandir(where) as entries:
            for e in entries:
                name = prefix + e.name
                if name == BLOBS and e.is_dir(follow_symlinks=False):
                    pending.append((Path(e.path), name + "/"))
                elif name not in expected:  # (a listed name that is not a regular file: refused when read)
                    count += 1
                    if len(extra) < 3:
                        extra.append(name + ("/" if e.is_dir(follow_symlinks=False) else ""))
    if count:
        covers = "its signature and manifest do not cover" if signed else "its manifest does not list"
        more = f" and {count - len(extra)} more" if count > len(extra) else ""
        raise PackError(f"the pack folder holds {count} file(s) {covers}: {', '.join(sorted(extra))}{more} "
                        "(a pack is its manifest, the blobs it lists and model.sig: get the pack again from its maker)")


def _for_this_model(m: Manifest, t: Target) -> None:
    mc = t.mc
    if m.record_format != keys.FORMAT_VERSION:
        raise PackError(f"the pack's records are format {m.record_format}; this kvstore stores format "
                        f"{keys.FORMAT_VERSION}")
    # (Exact mode first: its step is the records' length, so another one reads as another chunk size.)
    theirs, ours = m.layout.get("exact_prefill") if isinstance(m.layout, dict) else None, mc.exact
    if theirs != ours:
        raise PackError(f"the pack was made in exact mode {_bits(theirs)}, this store's is {_bits(ours)}: "
                        f"import it into a store opened with --exact-prefill {theirs or 'off'}")
    if m.chunk_size != mc.chunk_size:
        raise PackError(f"the pack's chunk size is {m.chunk_size} tokens, this store's is {mc.chunk_size}: "
                        f"import it into a store made with chunk_size={m.chunk_size} (kvstore.open's, in the "
                        "library; the commands use 256)")
    theirs, ours = acting_disk_kv_bits(m.layout, m.disk_kv_bits), acting_disk_kv_bits(mc.layout, t.disk_kv_bits)
    if theirs != ours:
        # (The option is a kept setting: the hint says so, as following it changes the store for good.)
        raise PackError(f"the pack's disk_kv_bits is {_bits(theirs)}, this store's is {_bits(ours)}: import it "
                        f"with --disk-kv-bits {theirs or 0} (which the store then keeps for later runs), or "
                        "import it into another store")
    mine = t.identity if t.identity is not None else identity.identity(t.model_dir, t.tokenizer)
    why = identity.differences(mine, m.files, m.tokenizer, m.chat_template)
    if why is not None:
        raise PackError(why)
    if m.fingerprint != mc.fingerprint.hex():
        raise PackError(f"kvstore's fingerprint of this model is {mc.fingerprint.hex()}, the pack's is "
                        f"{m.fingerprint}: it was made with other model files")
    if _canonical(m.layout) != _canonical(mc.layout):
        raise PackError("the pack's cache layout is not this model's as bound here (bind options such as "
                        "kv_bits, or disk_kv_bits, differ)")
    if m.namespace != mc.ns.hex():
        raise PackError(f"the pack's namespace {m.namespace} is not this model's ({mc.ns.hex()})")


def acting_disk_kv_bits(layout: object, bits: int | None) -> int | None:
    """`disk_kv_bits` as it acts on a model of this cache layout: None where no layer is stored
    quantized (K/V in float32: the setting has no effect, and the records are those of a store
    without it)."""
    return bits if layout_bits(layout) is not None else None


def _bits(bits: int | None) -> str:
    return "off" if bits is None else str(bits)


def _canonical(obj) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _read_blob(folder: Path, h: str, size: int) -> bytes:
    path = folder / blob_name(h)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise PackError(f"blob {blob_name(h)} is missing from the pack") from None
    if stat.S_ISREG(st.st_mode) and st.st_size != size:
        raise PackError(f"blob {blob_name(h)} is {st.st_size} bytes, the manifest says {size}")
    data = read_file(path, size)
    if len(data) != size:
        raise PackError(f"blob {blob_name(h)} is {len(data)} bytes, the manifest says {size}")
    return data


def _chain(m: Manifest, blobs: dict[str, bytes], mc) -> tuple[dict[str, tuple[Span, int]], list[np.ndarray]]:
    """Each prompt's token ids, read from its blobs and checked against the manifest, and the
    records they hash to: (record hash -> (its place in a chain, the first prompt it is in), every
    prompt's tokens)."""
    spans, prompts = {}, []
    for i, p in enumerate(m.prompts):
        parts, named = [], []
        for h in p.records:
            try:
                stored = blobformat.read_record(blobs[h], blob_name(h))
            except BlobError as e:
                raise PackError(f"blob {blob_name(h)} is not a record's blob: {e}") from None
            _shared(stored.metadata, h)
            parts.append(stored.tokens)
            named.append(stored.metadata.get("hash"))
        tokens = np.concatenate(parts).astype("<i4")
        if len(tokens) != p.tokens or sha256(tokens.tobytes()) != p.tokens_sha256:
            damaged = [h for h in p.records if sha256(blobs[h]) != m.records[h][1]]
            raise PackError(f"prompt {i + 1}: {_tokens_differ(p, i, len(tokens), named, damaged)}")
        chain = prompt_records(mc.ns, tokens, mc.chunk_size, checkpoint=mc.checkpointed)
        chain = with_checkpoints(chain, {bytes.fromhex(h) for h in p.records}) if mc.checkpointed else chain
        got = [s.hash.hex() for s in chain]
        if got != list(p.records):
            k = next((j for j, (a, b) in enumerate(zip(got, p.records)) if a != b), min(len(got), len(p.records)))
            raise PackError(f"prompt {i + 1}: the chain recomputed from its tokens differs from {MANIFEST}'s "
                            f"prompts[{i}].records at record {k + 1} of {len(p.records)}")
        for s in chain + _resume(i, p, tokens, chain, mc):
            spans.setdefault(s.hash.hex(), (s, i))
        prompts.append(tokens)
    return spans, prompts


def _resume(i: int, p: Prompt, tokens: np.ndarray, chain: list[Span], mc) -> list[Span]:
    """The records of prompt `i` at its last token but one that the manifest lists (`resume`),
    checked against those its tokens give (`ModelCache.resume_records`, less its chain's): where
    the same prompt asked again resumes on a model that restores only at a checkpoint or a whole
    window. A pack may have none (an older one, or the exporting store held none)."""
    if not p.resume:
        return []
    have = {s.hash for s in chain}
    want = [s for s in mc.resume_records(tokens) if s.hash not in have]
    if [s.hash.hex() for s in want] != list(p.resume):
        raise PackError(f"prompt {i + 1}: {MANIFEST}'s prompts[{i}].resume is not the records its tokens give at "
                        f"its last token but one ({plural(len(want), 'record')} for this model)")
    return want


def with_checkpoints(chain: list[Span], have) -> list[Span]:
    """A prompt's records (`prompt_records`, with its end checkpoint) and, after each of its
    chunks, the checkpoint taken at that chunk's end where `have` (a container of record hashes)
    holds it: a model with recurrent layers restores only at a checkpoint, and `warm` stores one
    every few chunks, where a request that leaves the prompt before its end (the same prompt
    again, a conversation after a system prompt rendered with its generation prompt) resumes."""
    out = []
    for k, s in enumerate(chain):
        out.append(s)
        if s.kind == CHUNK:
            c = checkpoint_of(s)
            if c.hash in have and not (k + 1 < len(chain) and chain[k + 1].hash == c.hash):
                out.append(c)
    return out


def _shared(metadata: dict[str, str], h: str) -> None:
    """PackError if the blob of record `h` is a tenant's record: only the shared namespace goes in
    a pack (a tenant's records are keyed under its own salt, so their chain is not the one the
    tokens make, and that is not the reason to give)."""
    try:
        tag, _ = tenants.stated(metadata)
    except ValueError as e:
        raise PackError(f"blob {blob_name(h)}: its tenant fields are not valid ({e})") from None
    if tag is not None:
        raise PackError(f"blob {blob_name(h)} holds a record of tenant {tag}: only the shared namespace's "
                        "records go in a pack (a tenant's never leave its store)")


def _tokens_differ(p: Prompt, i: int, count: int, named: list[str | None], damaged: list[str]) -> str:
    """Why a prompt's token ids, read from its blobs in the manifest's order (`count` of them;
    `named`: the record each blob's header names; `i`: the prompt's place in the manifest), are not the manifest's: first a blob that holds
    another record than the one the manifest puts there (two blobs swapped: the ids are all
    there, out of order), else a blob whose bytes are not the manifest's (`damaged`: their
    SHA-256 differs; a byte flipped among its token ids), else their count, else their SHA-256
    (the manifest's count or tokens_sha256 is not what its blobs were made with)."""
    n = len(p.records)
    for k, (h, other) in enumerate(zip(p.records, named)):
        if other != h:
            holds = (f"record {other} (its record {p.records.index(other) + 1}): blobs swapped or renamed"
                     if other in p.records else f"record {other}, not one of this prompt's"
                     if other else "a record its header does not name")
            return f"blob {blob_name(h)}, the manifest's record {k + 1} of {n}, holds {holds}"
    if damaged:
        more = f" (and {plural(len(damaged) - 1, 'other blob')})" if len(damaged) > 1 else ""
        return (f"blob {blob_name(damaged[0])}{more} does not match its SHA-256 in the manifest, and the token ids "
                "its blobs hold are not the manifest's")
    if count != p.tokens:
        return f"its blobs hold {count} token ids, {MANIFEST}'s prompts[{i}].tokens says {p.tokens}"
    return (f"the {count} token ids its blobs hold are not the ones the manifest names (their SHA-256 is not "
            f"{MANIFEST}'s prompts[{i}].tokens_sha256)")


def _ordered(m: Manifest) -> list[str]:
    """Every record once, parents first (the chains' order)."""
    return list(dict.fromkeys(h for p in m.prompts for h in (*p.records, *p.resume)))


def _record(span: Span, prompt: int, blob: bytes, mc) -> Checked:
    """A record's own checks: intact, the record it is in the chain, and of the model's shapes."""
    where = f"blob {blob_name(span.hash.hex())}"
    try:
        tokens = check_record(blob, span, mc.chunk_size)
        stored = blobformat.read_record(blob, where)
        meta = stored.metadata
        if meta.get("fingerprint") != mc.fingerprint.hex() or meta.get("format") != str(keys.FORMAT_VERSION):
            raise BlobError(f"{where}: its header names another model or record format")
        mc.check(span.kind, span.ntokens, {n: Entry(i["dtype"], tuple(i["shape"]))
                                           for n, i in stored.entries.items() if n != "tokens"})
    except BlobError as e:
        raise PackError(f"{where} fails its record checks: {e}") from None
    return Checked(span, np.array(tokens), blob, meta, prompt)


def _canaries(m: Manifest, checked: list[Checked], prompts: list[np.ndarray]) -> list:
    """(record, a prompt's tokens, canary fields) of every record with canaries; the manifest must
    list exactly the canary fields the blobs' headers carry."""
    out = []
    for c in checked:
        h = c.span.hash.hex()
        listed = m.canaries.get(h, {})
        try:
            fields = canary_fields(c.metadata)
        except BlobError as e:
            raise PackError(f"blob {blob_name(h)}: {e}") from None
        fields.update({k: c.metadata.get(EXTENSION_PREFIX + k) for k in listed if k not in fields})
        if fields != listed:
            raise PackError(f"blob {blob_name(h)}: its header's canaries are not the ones the manifest lists")
        if fields:
            out.append((c.span, prompts[c.prompt], fields))
    return out
