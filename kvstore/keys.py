"""Hashes: the model fingerprint, the namespace and the token-chunk hash chain.

Every key is xxh3 over explicit bytes, so it is the same in every process and on every machine
(never Python's `hash()`, never a random seed).
"""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np
import xxhash

#: Bumped whenever the meaning of stored bytes changes; part of every namespace.
FORMAT_VERSION = 1

HASH_BYTES = 16
_READ_BLOCK = 8 << 20

# Files whose contents decide what a model computes. Tokenizer files are left out on purpose:
# they change which tokens a text becomes, not the K/V of a given token sequence.
_WEIGHT_SUFFIXES = (".safetensors", ".npz", ".gguf", ".bin")


def namespace(fingerprint: bytes, layout: object, chunk_size: int) -> bytes:
    """`ns = xxh3_128(format version || model fingerprint || cache layout || chunk size)`."""
    h = xxhash.xxh3_128()
    h.update(FORMAT_VERSION.to_bytes(4, "little"))
    h.update(fingerprint)
    h.update(json.dumps(layout, sort_keys=True, separators=(",", ":")).encode())
    h.update(int(chunk_size).to_bytes(4, "little"))
    return h.digest()


def token_bytes(tokens: np.ndarray) -> bytes:
    """Token ids as little-endian int32, the byte form every hash uses."""
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()


def chain(ns: bytes, tokens: np.ndarray, chunk_size: int,
          link: Callable[[bytes], bytes] | None = None) -> list[bytes]:
    """Hashes `h_1..h_n` of the full chunks of `tokens`: `h_i = xxh3_128(h_{i-1} || chunk i)`,
    from `h_0 = ns`. With a tenant's `link` (`tenants.Tenant.link`), `h_i = xxh3_128(link(h_{i-1})
    || chunk i)`: a chain only that tenant can compute (`ns` is then the record it goes on from)."""
    raw = token_bytes(tokens)
    step = chunk_size * 4
    hashes: list[bytes] = []
    prev = ns
    for start in range(0, (len(raw) // step) * step, step):
        prev = xxhash.xxh3_128_digest((prev if link is None else link(prev)) + raw[start : start + step])
        hashes.append(prev)
    return hashes


def tail_hash(parent: bytes, tail_tokens: np.ndarray) -> bytes:
    """Key of a tail (1..C-1 tokens after the last full chunk) under its parent chunk hash.

    A tail is shorter than a chunk, so its input never equals a chunk's input.
    """
    return xxhash.xxh3_128_digest(parent + token_bytes(tail_tokens))


def checkpoint_hash(record_hash: bytes) -> bytes:
    """Key of the checkpoint taken at the end of a chunk or tail."""
    return xxhash.xxh3_128_digest(record_hash + b"\x00checkpoint")


def first_token(tokens: np.ndarray | bytes) -> int | None:
    """A record's first token id, as the index keeps it (None for a checkpoint: it has none)."""
    raw = tokens if isinstance(tokens, bytes) else token_bytes(tokens)
    return int.from_bytes(raw[:4], "little", signed=True) if len(raw) >= 4 else None


def is_address(h: bytes, parent: bytes, kind: int, tokens: np.ndarray) -> bool:
    """Whether `h` is the key of a record of `kind` (0 chunk, 1 tail, 2 checkpoint) that hangs
    from `parent` and holds `tokens`: a chunk's and a tail's key is xxh3_128(parent || token ids),
    a checkpoint's is made from its parent alone (and it holds no tokens)."""
    if kind == 2:
        return len(tokens) == 0 and checkpoint_hash(parent) == h
    return tail_hash(parent, tokens) == h


def file_digest(path: Path) -> bytes:
    """xxh3_128 of a file's whole contents. A FIFO or device in place of a weight file is an
    error (OSError), never a read that waits forever."""
    h = xxhash.xxh3_128()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        while block := f.read(_READ_BLOCK):
            h.update(block)
    return h.digest()


def model_files(model_dir: Path, adapter_dir: Path | None = None) -> list[Path]:
    """The files a model fingerprint covers: config.json, weight files, adapter files."""
    files: list[Path] = []
    for folder in (model_dir, adapter_dir):
        if folder is None:
            continue
        for p in sorted(folder.rglob("*")):
            if p.is_file() and (p.name.endswith(_WEIGHT_SUFFIXES) or p.name in (
                "config.json", "adapter_config.json")):
                files.append(p)
    return files


Memo = Callable[[Path, os.stat_result], "bytes | None"]
Remember = Callable[[Path, os.stat_result, bytes], None]


def fingerprint(
    files: Iterable[Path],
    root: Path,
    lookup: Memo | None = None,
    remember: Remember | None = None,
) -> bytes:
    """Hash of every file's name (relative to `root`) and full contents (see `file_digests`)."""
    files = list(files)
    return combine(files, root, file_digests(files, lookup, remember))


def file_digests(files: Sequence[Path], lookup: Memo | None = None,
                 remember: Remember | None = None) -> list[bytes]:
    """`file_digest` of each file, memoised.

    `lookup`/`remember` memoise per-file digests by the file's `os.stat` (path, size, mtime,
    device, inode and ctime), so that reopening a model whose files did not change reads none of
    them, and weights rewritten in place (even with their mtime put back) are hashed again.
    """
    out = []
    for p in files:
        st = os.stat(p)
        digest = lookup(p, st) if lookup else None
        if digest is None:
            digest = file_digest(p)
            after = os.stat(p)
            # Written to while it was read: hash it again next time, do not remember this digest.
            if remember and (after.st_mtime_ns, after.st_ctime_ns, after.st_size) == (
                    st.st_mtime_ns, st.st_ctime_ns, st.st_size):
                remember(p, st, digest)
        out.append(digest)
    return out


def combine(files: Sequence[Path], root: Path, digests: Sequence[bytes]) -> bytes:
    """The fingerprint of `files` (named relative to `root`) whose contents hash to `digests`."""
    h = xxhash.xxh3_128()
    for p, digest in zip(files, digests):
        try:
            name = p.relative_to(root).as_posix()
        except ValueError:
            name = "adapter/" + p.name
        h.update(name.encode() + b"\0" + digest)
    return h.digest()


def common_prefix(a: Sequence[int] | np.ndarray, b: Sequence[int] | np.ndarray) -> int:
    """Length of the common prefix of two token sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if len(diff) else n
