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

from kvstore import keys
from kvstore.errors import PackError

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


def file_sha256(path: Path) -> str:
    """SHA-256 of a regular file's contents (a FIFO or device in its place is an OSError)."""
    h = hashlib.sha256()
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", buffering=0) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def chat_template_sha256(tokenizer) -> str | None:
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not template:
        return None
    return hashlib.sha256(template.encode()).hexdigest()


def identity(model_dir: Path, tokenizer) -> Identity:
    """The SHA-256s of the model in `model_dir`, loaded with `tokenizer`."""
    try:
        files = {p.relative_to(model_dir).as_posix(): file_sha256(p) for p in keys.model_files(model_dir)}
        toks = {name: file_sha256(model_dir / name) for name in TOKENIZER_FILES if (model_dir / name).is_file()}
    except OSError as e:
        raise PackError(f"cannot hash the model's files in {model_dir}: {e}") from None
    return Identity(files, toks, chat_template_sha256(tokenizer))


def differences(mine: Identity, files: dict[str, str], tokenizer: dict[str, str],
                chat_template: str | None) -> str | None:
    """Why a pack made with these hashes is not for this model (weights first), or None."""
    for what, have, want in (("weight", mine.files, files), ("tokenizer", mine.tokenizer, tokenizer)):
        if have == want:
            continue
        changed = sorted(n for n in set(have) & set(want) if have[n] != want[n])
        if changed:
            n = changed[0]
            return (f"this model's {what} file {n} has SHA-256 {have[n][:16]}..., the pack was made with "
                    f"{want[n][:16]}... ({len(changed)} {what} file(s) differ): a pack is only for the model "
                    "and tokenizer it was made with")
        return (f"this model's {what} files are {sorted(have)}, the pack's are {sorted(want)}: a pack is only "
                "for the model and tokenizer it was made with")
    if mine.chat_template != chat_template:
        return (f"this tokenizer's chat template has SHA-256 {str(mine.chat_template)[:16]}..., the pack was "
                f"made with {str(chat_template)[:16]}...")
    return None
