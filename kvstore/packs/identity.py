"""Which model and tokenizer a pack was made with, by SHA-256: each file kvstore's fingerprint
covers (`config.json` and the weight files), each tokenizer file, and the chat template's text.

A pack is refused by a model whose files differ, named file by file. The tokenizer is checked too,
though it does not change what K/V a token sequence has: a pack's prompts were tokenized by it,
and the same text through another tokenizer is other tokens.
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvstore import keys
from kvstore.errors import PackError
from kvstore.model.fingerprint import Memo

#: Tokenizer files a model folder may hold (those present are hashed).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "vocab.json", "vocab.txt", "merges.txt",
                   "chat_template.jinja", "chat_template.json")
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Identity:
    files: dict[str, str]  # config.json and weight files (relative names) -> SHA-256
    tokenizer: dict[str, str]  # tokenizer files present -> SHA-256
    chat_template: str | None  # SHA-256 of the chat template's text, None without one
    fingerprint: bytes = b""  # kvstore's fingerprint of the same files (their xxh3, as a store binds them)
    fresh: tuple = ()  # (kind, path, stat, digest) of each digest read now, for a memo to remember


def _read_hashes(path: Path, want_xxh3: bool) -> tuple[bytes, bytes | None]:
    """(SHA-256, and xxh3_128 if wanted) of a regular file's contents, in one read (a FIFO or
    device in its place is an OSError)."""
    sha, xxh = hashlib.sha256(), xxhash.xxh3_128() if want_xxh3 else None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            sha.update(view[:n])
            if xxh is not None:
                xxh.update(view[:n])
    return sha.digest(), xxh.digest() if xxh is not None else None


def chat_template_sha256(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return None
    return hashlib.sha256(template.encode()).hexdigest()


def identity(model_dir: Path, tokenizer, memo: Memo | None = None) -> Identity:
    """The SHA-256s of the model in `model_dir`, loaded with `tokenizer`, and its fingerprint.

    Each file is read once for both of its hashes, and not at all where `memo` (the store's
    memo of file digests: `model.fingerprint.Memo`) holds it unchanged since it was hashed;
    what is hashed is remembered there when the memo may write (and is in `fresh`, for a memo
    that may write later: an import checks against its store read-only)."""
    model_files = keys.model_files(model_dir)
    names = [(p, True) for p in model_files] + [(model_dir / n, False) for n in TOKENIZER_FILES
                                                 if (model_dir / n).is_file()]
    sha, xxh, fresh = {}, [], []
    try:
        for path, fingerprinted in names:
            st = os.stat(path)
            s = memo.get("sha256", path, st) if memo else None
            x = memo.get("xxh3", path, st) if memo and fingerprinted else None
            if s is None or (fingerprinted and x is None):
                s, x = _read_hashes(path, fingerprinted)
                after = os.stat(path)  # written to while it was read: remembered next time, not now
                if (after.st_mtime_ns, after.st_ctime_ns, after.st_size) == (st.st_mtime_ns, st.st_ctime_ns,
                                                                             st.st_size):
                    fresh += [("sha256", path, st, s)] + ([("xxh3", path, st, x)] if fingerprinted else [])
            sha[path] = s.hex()
            if fingerprinted:
                xxh.append(x)
    except OSError as e:
        raise PackError(f"cannot hash the model's files in {model_dir}: {e}") from None
    if memo:
        remember(memo, fresh)
    return Identity({p.relative_to(model_dir).as_posix(): sha[p] for p in model_files},
                    {p.name: sha[p] for p, f in names if not f}, chat_template_sha256(tokenizer),
                    keys.combine(model_files, model_dir, xxh), tuple(fresh))


def memo_of(store, *, remember: bool) -> Memo | None:
    """A store's memo of file digests (None for a store in RAM)."""
    return Memo(store.index, store.trust, remember=remember) if store.index is not None and store.trust else None


def remember(memo: Memo, fresh) -> None:
    """Write digests read by `identity` (its `fresh`) to a store's memo (if it may write)."""
    for kind, path, st, digest in fresh:
        memo.put(kind, path, st, digest)


def differences(mine: Identity, files: dict[str, str], tokenizer: dict[str, str],
                chat_template: str | None) -> str | None:
    """Why a pack made with these hashes is not for this model (weights first), or None."""
    for what, have, want in (("weight or config", mine.files, files), ("tokenizer", mine.tokenizer, tokenizer)):
        if have == want:
            continue
        changed = sorted(n for n in set(have) & set(want) if have[n] != want[n])
        if changed:
            n = changed[0]
            kind = "config" if n == "config.json" else what.split()[0]  # ("weight file config.json" it is not)
            return (f"this model's {kind} file {n} has SHA-256 {have[n][:16]}..., the pack was made with "
                    f"{want[n][:16]}... ({len(changed)} {what} file(s) differ): a pack is only for the model "
                    "and tokenizer it was made with")
        return (f"this model's {what} files are {sorted(have)}, the pack's are {sorted(want)}: a pack is only "
                "for the model and tokenizer it was made with")
    if mine.chat_template != chat_template:
        def said(digest: str | None) -> str:
            return f"one with SHA-256 {digest[:16]}..." if digest else "no chat template"
        return f"this tokenizer has {said(mine.chat_template)}, the pack was made with {said(chat_template)}"
    return None
