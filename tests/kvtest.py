"""Helpers shared by the tests (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import struct
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import mlx.core as mx
import numpy as np
import xxhash
from mlx_lm.models.cache import make_prompt_cache

from kvstore.model.prefill import model_tokens


def prefill(model, tokens):
    """A fresh cache of `model` holding `tokens`, computed in one step."""
    _in_vocab(model, tokens)
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def _in_vocab(model, tokens) -> None:
    """The model reads ids past its vocabulary outside its embedding table (garbage, or a crash):
    a test that gives it one tests nothing. The product's own check refuses them."""
    model_tokens(model, np.asarray(tokens).reshape(-1))


def logits_diff(model, cache, rest, query) -> float:
    """Max |logits| difference at the last position: restored cache + `rest` vs `query` from scratch."""
    _in_vocab(model, query)
    logits = model(mx.array([rest]), cache=cache)
    ref = model(mx.array([query]), cache=make_prompt_cache(model))
    return float(mx.abs(logits[0, -1] - ref[0, -1]).max().item())


def run_procs(mode: str, store, model, chunk: int, tokens, **extra) -> dict:
    """Run `tests/procs.py MODE` (insert or check a prompt) in a fresh process; its last JSON line."""
    cmd = [sys.executable, str(Path(__file__).parent / "procs.py"), mode, str(store), str(model),
           str(chunk), json.dumps(tokens), json.dumps(extra)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@contextmanager
def readers(store, model_dir, queries: list[list[int]], chunk: int, work: Path, *, n: int = 1,
            min_fetches: int = 0) -> Iterator[Callable[[], list[dict]]]:
    """`n` processes (`tests/reader_proc.py`) that fetch `queries` round and round from `store`
    and check each restore against a recompute, ready when this enters. Within, `finish()` stops
    them (each after `min_fetches` fetches at least) and returns their results; they are killed
    if the block leaves without it."""
    here = Path(__file__).parent
    work = Path(work)
    (work / "queries.json").write_text(json.dumps(queries))
    stop = work / "stop"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(here.parent), str(here)]))
    procs = [subprocess.Popen([sys.executable, str(here / "reader_proc.py"), str(store), str(model_dir), str(chunk),
                               str(work / "queries.json"), str(stop), str(min_fetches)],
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(n)]

    def finish() -> list[dict]:
        stop.touch()
        return [json.loads(p.stdout.read().strip().splitlines()[-1]) for p in procs]

    try:
        for p in procs:
            assert json.loads(p.stdout.readline()) == {"ready": True}
        yield finish
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()


def run_cli(*args, check: bool = True) -> subprocess.CompletedProcess:
    """`kvstore ARGS...` in this process (no interpreter and mlx-lm start-up to pay for: about
    2 s of CPU a command), with what it printed; for tests of what a command says and does, not
    of what a process of its own does at exit (those start one)."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from kvstore.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    # A command's own process logs kvstore's warnings to stderr, as bare messages (logging's last
    # resort): the same here, where pytest's handlers would otherwise take them.
    shown = logging.StreamHandler(err)
    shown.setLevel(logging.WARNING)
    logger = logging.getLogger("kvstore")
    logger.addHandler(shown)
    try:
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main([str(a) for a in args])
            except SystemExit as e:  # argparse's usage errors
                code = e.code if isinstance(e.code, int) else 1
    finally:
        logger.removeHandler(shown)
    result = subprocess.CompletedProcess(["kvstore", *map(str, args)], code, out.getvalue(), err.getvalue())
    if check:
        assert code == 0 and "Traceback" not in result.stderr, result.stdout + result.stderr
    return result


def alter_record(store: Path, h: bytes, name: str, factor: float, *, strip_tag: bool = False) -> None:
    """What a writer of a store folder can do without a key: scale float32 tensor `name` of record
    `h` and write its checksum with it (and the row's size and checksum), so that no checksum
    tells it from the record that was stored. The header keeps its length, and its trust tag
    (`x-trust`) unless `strip_tag`."""
    from kvstore.storage import blobformat, blobtree
    from kvstore.trust import HEADER_KEY

    path = blobtree.blob_path(store / "blobs", h)
    buf = bytearray(path.read_bytes())
    (n,) = struct.unpack_from("<Q", buf, 0)
    header = json.loads(buf[8 : 8 + n])
    start, end = header[name]["data_offsets"]
    data = np.frombuffer(bytes(buf[8 + n + start : 8 + n + end]), dtype="<f4") * np.float32(factor)
    buf[8 + n + start : 8 + n + end] = data.tobytes()
    sums = json.loads(header["__metadata__"]["checksums"])
    sums[name] = blobformat.tensor_checksum(data)
    header["__metadata__"]["checksums"] = json.dumps(sums, separators=(",", ":"))
    if strip_tag:
        header["__metadata__"].pop(HEADER_KEY, None)
    rewrite_blob(store, h, buf, header)


def rewrite_blob(store: Path, h: bytes, buf: bytearray, header: dict) -> None:
    """Write record `h`'s blob as `buf` with `header` (as long as the one it had: the payload
    stays where it was), and its row's size and whole-file checksum to match: damage no checksum
    tells from the record that was stored."""
    from kvstore.storage import blobtree

    (n,) = struct.unpack_from("<Q", buf, 0)
    raw = json.dumps(header, separators=(",", ":")).encode()
    buf[8 : 8 + n] = raw + b" " * (n - len(raw))
    blobtree.blob_path(store / "blobs", h).write_bytes(bytes(buf))
    checksum = xxhash.xxh3_64_intdigest(bytes(buf))
    with sqlite3.connect(store / "index.sqlite") as con:
        con.execute("UPDATE records SET size = ?, checksum = ? WHERE hash = ?",
                    (len(buf), checksum - (1 << 64) if checksum >= 1 << 63 else checksum, h))
    con.close()


def rewrite_pack_tensors(pack: Path, record: str, change: Callable[[str, dict, bytes], bytes | None]) -> None:
    """Rewrite the tensors of one record of the pack folder `pack`: `change(name, info, raw)`
    gives a tensor's new bytes (None: left as it is); its checksums, blob SHA-256 and size in the
    manifest are made to match (as someone rewriting a pack would)."""
    import hashlib

    from kvstore.packs import manifest as packfile
    from kvstore.storage import blobformat

    path = pack / packfile.blob_name(record)
    data = bytearray(path.read_bytes())
    entries, base, meta = blobformat.parse(bytes(data))
    sums = json.loads(meta["checksums"])
    for name, info in entries.items():
        start, end = (base + o for o in info["data_offsets"])
        new = change(name, info, bytes(data[start:end]))
        if new is not None:
            data[start:end] = new
            sums[name] = xxhash.xxh3_64_hexdigest(new)
    out = blobformat.restamp(bytes(data), {**meta, "checksums": json.dumps(sums, separators=(",", ":"))})
    path.write_bytes(out)
    doc = json.loads((pack / "manifest.json").read_text())
    doc["records"][record] = {"bytes": len(out), "sha256": hashlib.sha256(out).hexdigest()}
    (pack / "manifest.json").write_text(json.dumps(doc))


def index_sql(store: Path, statement: str, params=()) -> list:
    """What `statement` returns, run on the index of the store folder `store` (tests plant damage
    with it), in a transaction of its own."""
    con = sqlite3.connect(store / "index.sqlite")
    try:
        with con:
            return con.execute(statement, params).fetchall()
    finally:
        con.close()
