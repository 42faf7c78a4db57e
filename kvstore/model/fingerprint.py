"""Which model version a bound model is: its files' fingerprint, memoised in the index, and the
stamps and digests of those files (to tell later whether they changed)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from pathlib import Path

from kvstore import keys
from kvstore.errors import InvalidInputError, ModelFilesError
from kvstore.storage.index import Index
from kvstore.storage.stale import RecordedFile
from kvstore.storage.stale import stamps as file_stamps
from kvstore.trust import Trust

log = logging.getLogger("kvstore")


def resolve_model_dir(model_id: str) -> Path:
    """The local folder of a model path or an already-downloaded Hugging Face repo id."""
    p = Path(model_id).expanduser()
    if p.is_dir():
        return p.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model_id, local_files_only=True))
    except Exception as e:
        raise ModelFilesError(
            f"cannot find the files of model {model_id!r} to fingerprint them: pass the local "
            "folder it was loaded from (or a repo id that is already downloaded)") from e


# The fields of a config that fix a model's architecture and shapes, as mlx-lm's `model.args` has them.
_SHAPE_FIELDS = ("model_type", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "intermediate_size", "vocab_size")


def fingerprint(model_id: str, adapter_path, index: Index | None, *, remember: bool,
                trust: Trust | None = None, model=None) -> tuple[bytes, list[RecordedFile]]:
    """(the fingerprint of a model's files (config, weights, adapter), each file's stamp and
    digest); each digest memoised in `index` (and, with `remember`, written there), used only
    under `trust` (`Memo`). `model`: the loaded model, refused when the files are another's."""
    if not isinstance(model_id, (str, os.PathLike)):  # (str() of a model is its whole module tree)
        raise InvalidInputError(f"model_id: give the folder or Hugging Face repo id the model was loaded "
                                f"from, not {type(model_id).__name__}")
    if adapter_path is not None and not isinstance(adapter_path, (str, os.PathLike)):
        raise InvalidInputError(f"adapter_path: give the folder of the adapter loaded with the model (or None), "
                                f"not {type(adapter_path).__name__}")
    model_dir = resolve_model_dir(str(model_id))
    if model is not None:
        check_loaded(model, model_dir, model_id)
    adapter_dir = Path(adapter_path) if adapter_path is not None else None
    if adapter_dir is not None and not adapter_dir.is_dir():
        raise ModelFilesError(f"adapter folder {adapter_dir} does not exist")
    files = keys.model_files(model_dir, adapter_dir)
    if not any(f.name == "config.json" for f in files):
        raise ModelFilesError(f"{model_dir} has no config.json: is it an mlx-lm model folder?")
    # Stamped before hashing: a file that changes meanwhile shows as changed later.
    stamps = file_stamps(files)
    memo = Memo(index, trust, remember=remember) if index is not None and trust is not None else None
    digests = keys.file_digests(files, memo and memo.lookup("xxh3"), memo and memo.keeper("xxh3"))
    recorded = [(*s, d) for s, d in zip(stamps, digests)]
    return keys.combine(files, model_dir, digests), recorded


def check_loaded(model, model_dir: Path, model_id) -> None:
    """Refuse a loaded `model` whose own config (mlx-lm's `model.args`) differs from the
    config.json of `model_dir` in a field that fixes its architecture or shapes: its K/V would be
    stored under the other model's fingerprint, and served to it when they have the same shapes."""
    args = getattr(model, "args", None)
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return  # (fingerprinting says what is wrong with the folder)
    if args is None or not isinstance(config, dict):
        return
    for name in _SHAPE_FIELDS:
        loaded, files = getattr(args, name, None), config.get(name)
        if type(loaded) is type(files) and type(loaded) in (int, str) and loaded != files:
            raise InvalidInputError(
                f"model_id: {str(model_id)!r} is not the model given to bind: its config.json has {name}={files!r}, "
                f"the loaded model {name}={loaded!r}; give the folder or repo id the model was loaded from")


class Memo:
    """A store's memo of file digests (`kind`: xxh3, which fingerprints use, or sha256, which
    packs name), keyed by each file's path and stamp. A row is used only if its tag holds under
    `trust` (a writer of the store folder could plant one that names other weights' digest, and
    so another model's namespace): else the file is hashed again. With `remember`, what is
    hashed is written, with its tag (a full disk or a busy index only loses the memo)."""

    def __init__(self, index: Index, trust: Trust, *, remember: bool):
        self.index, self.trust, self.remember = index, trust, remember

    def get(self, kind: str, path: Path, st: os.stat_result) -> bytes | None:
        try:
            found = self.index.file_digest(path, st, kind)
        except sqlite3.OperationalError:  # only a memo
            return None
        if found is None or not self.trust.memo_ok(str(path), _memo_stamp(st), *found, kind=kind):
            return None
        return found[0]

    def put(self, kind: str, path: Path, st: os.stat_result, digest: bytes) -> None:
        if not self.remember:
            return
        try:
            self.index.remember_file_digest(path, st, digest,
                                            self.trust.memo_tag(str(path), _memo_stamp(st), digest, kind), kind)
        except sqlite3.OperationalError:  # only a memo (the disk may be full)
            pass

    def lookup(self, kind: str):
        return lambda path, st: self.get(kind, path, st)

    def keeper(self, kind: str):
        return lambda path, st, digest: self.put(kind, path, st, digest)


def _memo_stamp(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, st.st_ctime_ns)


def register(index: Index, ns: bytes, fingerprint: bytes, model_id: str, layout: dict, chunk_size: int,
             stamps: list | None = None) -> bool:
    """Record a bound model version in the index (with its files' stamps and digests); False if the index
    cannot be written now (a full disk, a busy index): fetch goes on, inserts wait until it works."""
    try:
        index.register_model(ns, fingerprint, model_id, json.dumps(layout), chunk_size)
        if stamps:
            index.record_model_files(ns, stamps)
        return True
    except sqlite3.OperationalError as e:
        log.warning("kvstore: cannot record model %s in the index (%s): serving reads only "
                    "until it can be written", model_id, e)
        return False
