"""A pack's `manifest.json`: what it binds its blobs to, written and read back strictly.

A pack is a folder: `manifest.json`, one blob file per record (`blobs/<hash>.safetensors`,
a record's blob as the store keeps it, without the exporter's `model_id`), and, when signed,
`model.sig` (an OpenSSF model-signing bundle over every other file). The manifest says:

- `kvstore_pack`: the pack format (1); `record_format`: the store's record format (keys.FORMAT_VERSION);
- `model`: kvstore's fingerprint of the model, the SHA-256 of each file it covers (`config.json`
  and the weight files), of each tokenizer file, and of the chat template's text (or null);
- `namespace`, `layout`, `chunk_size`, `disk_kv_bits`: where the records live and how they are cut;
- `prompts`: per prompt, its token count, the SHA-256 of its token ids (little-endian int32), the
  chain of its record hashes, parents first, and (`resume`, only where there are any) the records
  stored at its last token but one besides them, where the same prompt asked again resumes on a
  model that restores only at a checkpoint or a whole window (`ModelCache.resume_records`);
- `records`: per record hash, its blob's size and SHA-256;
- `canaries`: per record hash, the canary fields its blob's header carries (none if no record has any).

Parsing never trusts the file: every field is checked for its type and bounds, and an unknown
field is an error. Knows JSON and hashes; no files, no mlx.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from typing import Any

from kvstore.errors import PackError

PACK_FORMAT = 1
MANIFEST = "manifest.json"
SIGNATURE = "model.sig"
BLOBS = "blobs"
MAX_MANIFEST_BYTES = 64 << 20
MAX_RECORDS = 1 << 20
_HEX32 = re.compile(r"[0-9a-f]{32}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_FILE_NAME = re.compile(r"[A-Za-z0-9._-][A-Za-z0-9._/-]{0,254}")
_FIELDS = ("kvstore_pack", "record_format", "model", "namespace", "layout", "chunk_size", "disk_kv_bits",
           "prompts", "records", "canaries")
_MODEL_FIELDS = ("fingerprint", "files", "tokenizer", "chat_template")


def blob_name(h: bytes | str) -> str:
    """A record's blob file, relative to the pack folder."""
    return f"{BLOBS}/{h if isinstance(h, str) else h.hex()}.safetensors"


def sha256(data) -> str:
    return hashlib.sha256(data).hexdigest()


@dataclass(frozen=True)
class Prompt:
    """One prompt of a pack: how many tokens, their SHA-256, its records (hex), parents first,
    and the records where the same prompt asked again resumes (hex, parents first)."""

    tokens: int
    tokens_sha256: str
    records: tuple[str, ...]
    resume: tuple[str, ...] = ()  # the records at its last token but one, beside `records` (hex)


@dataclass(frozen=True)
class Manifest:
    record_format: int
    fingerprint: str
    files: dict[str, str]  # model file (relative name) -> SHA-256
    tokenizer: dict[str, str]  # tokenizer file -> SHA-256
    chat_template: str | None
    namespace: str
    layout: dict
    chunk_size: int
    disk_kv_bits: int | None
    prompts: tuple[Prompt, ...]
    records: dict[str, tuple[int, str]]  # record hash -> (blob bytes, blob SHA-256)
    canaries: dict[str, dict[str, str]]  # record hash -> {canary field: its text}

    def to_json(self) -> bytes:
        doc = {
            "kvstore_pack": PACK_FORMAT, "record_format": self.record_format,
            "model": {"fingerprint": self.fingerprint, "files": self.files, "tokenizer": self.tokenizer,
                      "chat_template": self.chat_template},
            "namespace": self.namespace, "layout": self.layout, "chunk_size": self.chunk_size,
            "disk_kv_bits": self.disk_kv_bits,
            "prompts": [{"tokens": p.tokens, "tokens_sha256": p.tokens_sha256, "records": list(p.records),
                         **({"resume": list(p.resume)} if p.resume else {})} for p in self.prompts],
            "records": {h: {"bytes": n, "sha256": s} for h, (n, s) in self.records.items()},
            "canaries": self.canaries,
        }
        return (json.dumps(doc, indent=1, sort_keys=True) + "\n").encode()

    def files_listed(self) -> dict[str, str]:
        """Every file of the pack but the signature: relative name -> SHA-256 (the manifest's own
        digest is not in it: it cannot list itself)."""
        return {blob_name(h): s for h, (_, s) in self.records.items()}

    @property
    def total_bytes(self) -> int:
        return sum(n for n, _ in self.records.values())


def parse(data: bytes) -> Manifest:
    """The manifest in `data`, every field checked; PackError naming the first bad one."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise PackError(f"{MANIFEST} is {len(data)} bytes, more than a pack's manifest can be")
    try:
        doc = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise PackError(f"{MANIFEST} is not JSON ({e})") from None
    _keys(doc, _FIELDS, "its top level")
    if doc["kvstore_pack"] != PACK_FORMAT or type(doc["kvstore_pack"]) is not int:
        raise PackError(f"{MANIFEST}: pack format {doc['kvstore_pack']!r} is not one this kvstore reads "
                        f"({PACK_FORMAT})")
    model = doc["model"]
    _keys(model, _MODEL_FIELDS, "model")
    records = _records(doc["records"])
    prompts = tuple(_prompt(p, i, records) for i, p in enumerate(_list(doc["prompts"], "prompts")))
    used = {h for p in prompts for h in (*p.records, *p.resume)}
    if set(records) != used:
        raise PackError(f"{MANIFEST}: records {sorted(set(records) ^ used)[:3]} are listed but in no prompt, "
                        "or in a prompt but not listed")
    canaries = _canaries(doc["canaries"], records)
    bits = doc["disk_kv_bits"]
    if bits is not None and (type(bits) is not int or bits not in (4, 8)):
        raise PackError(f"{MANIFEST}: disk_kv_bits must be null, 4 or 8, got {bits!r}")
    if not isinstance(doc["layout"], dict):
        raise PackError(f"{MANIFEST}: layout must be an object")
    template = model["chat_template"]
    if template is not None:
        _hex(template, _HEX64, "model.chat_template")
    return Manifest(
        record_format=_int(doc["record_format"], "record_format", 1, 1 << 30),
        fingerprint=_hex(model["fingerprint"], _HEX32, "model.fingerprint"),
        files=_digests(model["files"], "model.files"), tokenizer=_digests(model["tokenizer"], "model.tokenizer"),
        chat_template=template, namespace=_hex(doc["namespace"], _HEX32, "namespace"), layout=doc["layout"],
        chunk_size=_int(doc["chunk_size"], "chunk_size", 1, 1 << 20), disk_kv_bits=bits,
        prompts=prompts, records=records, canaries=canaries)


def _keys(obj: Any, fields: tuple, where: str, optional: tuple = ()) -> None:
    if not isinstance(obj, dict):
        raise PackError(f"{MANIFEST}: {where} must be an object")
    extra, missing = sorted(set(obj) - set(fields) - set(optional)), sorted(set(fields) - set(obj))
    if extra or missing:
        what = ([f"fields it should not have: {', '.join(map(repr, extra))}"] if extra else []) + \
               ([f"no {', '.join(map(repr, missing))}"] if missing else [])
        raise PackError(f"{MANIFEST}: {where} has {' and '.join(what)}")


def _int(v: Any, where: str, lo: int, hi: int) -> int:
    if type(v) is not int or not lo <= v <= hi:
        raise PackError(f"{MANIFEST}: {where} must be a whole number from {lo} to {hi}, got {v!r}")
    return v


def _hex(v: Any, pattern: re.Pattern, where: str) -> str:
    if not isinstance(v, str) or not pattern.fullmatch(v):
        digits = 32 if pattern is _HEX32 else 64
        raise PackError(f"{MANIFEST}: {where} must be {digits} lower-case hex digits, got {str(v)[:80]!r}")
    return v


def _list(v: Any, where: str) -> list:
    if not isinstance(v, list) or not 0 < len(v) <= MAX_RECORDS:
        raise PackError(f"{MANIFEST}: {where} must be a list of 1 to {MAX_RECORDS} entries")
    return v


def _digests(v: Any, where: str) -> dict[str, str]:
    if not isinstance(v, dict) or len(v) > 4096:
        raise PackError(f"{MANIFEST}: {where} must be an object of file name -> SHA-256")
    for name, digest in v.items():
        if not _FILE_NAME.fullmatch(name) or ".." in name.split("/"):
            raise PackError(f"{MANIFEST}: {where} names a file {name[:80]!r} that is not a plain relative name")
        _hex(digest, _HEX64, f"{where}[{name!r}]")
    return dict(v)


def _records(v: Any) -> dict[str, tuple[int, str]]:
    if not isinstance(v, dict) or not 0 < len(v) <= MAX_RECORDS:
        raise PackError(f"{MANIFEST}: records must be an object of 1 to {MAX_RECORDS} records")
    out = {}
    for h, entry in v.items():
        _hex(h, _HEX32, "a record hash")
        _keys(entry, ("bytes", "sha256"), f"records[{h}]")
        out[h] = (_int(entry["bytes"], f"records[{h}].bytes", 8, 4 << 30),
                  _hex(entry["sha256"], _HEX64, f"records[{h}].sha256"))
    return out


def _prompt(p: Any, i: int, records: dict) -> Prompt:
    where = f"prompts[{i}]"
    _keys(p, ("tokens", "tokens_sha256", "records"), where, optional=("resume",))
    hashes = _listed(_list(p["records"], f"{where}.records"), f"{where}.records", records)
    resume = _listed(_list(p["resume"], f"{where}.resume"), f"{where}.resume", records) if "resume" in p else ()
    return Prompt(_int(p["tokens"], f"{where}.tokens", 1, 1 << 31),
                  _hex(p["tokens_sha256"], _HEX64, f"{where}.tokens_sha256"), hashes, resume)


def _listed(hashes: list, where: str, records: dict) -> tuple[str, ...]:
    """Record hashes of a prompt, each one the pack lists."""
    for h in hashes:
        _hex(h, _HEX32, where)
        if h not in records:
            raise PackError(f"{MANIFEST}: {where} names record {h}, which the pack does not list")
    return tuple(hashes)


def _canaries(v: Any, records: dict) -> dict[str, dict[str, str]]:
    if not isinstance(v, dict):
        raise PackError(f"{MANIFEST}: canaries must be an object of record hash -> fields")
    for h, fields in v.items():
        if h not in records:
            raise PackError(f"{MANIFEST}: canaries name record {h[:40]!r}, which the pack does not list")
        if not isinstance(fields, dict) or not fields or not all(
                isinstance(k, str) and isinstance(t, str) and len(t) <= 1 << 16 for k, t in fields.items()):
            raise PackError(f"{MANIFEST}: canaries[{h}] must be an object of field name -> text")
    return {h: dict(f) for h, f in v.items()}
