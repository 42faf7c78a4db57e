"""Blob format 2: per-tensor checksums in the header, `verify_bytes`, and stores written in the
0.1 format (no per-tensor checksums) that must keep restoring."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import xxhash

import kvstore
from kvstore.errors import BlobError
from kvstore.storage import blobfile, blobformat, blobtree, blobwrite, readplan

HERE = Path(__file__).parent
H = bytes(range(16))


def tensors():
    rng = np.random.default_rng(0)
    return {
        "tokens": ("I32", np.arange(7, dtype="<i4")),
        "0.keys": ("F32", rng.standard_normal((1, 2, 7, 4)).astype("<f4")),
        "0.values": ("BF16", rng.integers(0, 1 << 16, (1, 2, 7, 4)).astype("<u2")),
        "1.state": ("I8", rng.integers(-5, 5, (3,)).astype("i1")),
        "empty": ("F16", np.zeros((1, 2, 0, 4), dtype="<f2")),
    }


def written(tmp_path) -> tuple[bytes, int, int]:
    size, checksum = blobwrite.write(tmp_path, H, tensors(), {"hash": H.hex(), "kind": "0"}, fsync=False)
    return blobtree.blob_path(tmp_path, H).read_bytes(), size, checksum


def test_write_records_format_and_every_tensors_checksum(tmp_path):
    buf, size, checksum = written(tmp_path)
    assert size == len(buf) and checksum == xxhash.xxh3_64_intdigest(buf)  # the row's whole-file sum
    meta = blobformat.header_metadata(buf)
    assert meta["blob_format"] == "2"
    sums = json.loads(meta["checksums"])
    header, base = blobformat.parse_header(buf)
    assert set(sums) == set(tensors()) == set(header)
    for name, (_, arr) in tensors().items():
        start, end = header[name]["data_offsets"]
        assert sums[name] == xxhash.xxh3_64_hexdigest(buf[base + start : base + end])
        assert sums[name] == xxhash.xxh3_64_hexdigest(arr.tobytes())
        assert len(sums[name]) == 16


def test_tensor_data_starts_on_64_bytes_and_the_blob_stays_plain_safetensors(tmp_path):
    """The kernel copies out of the page cache fastest when a tensor's bytes in the file and its
    place in memory are aligned alike, so every tensor whose size is a multiple of 64 starts on 64
    bytes (those of other sizes, such as 7 token ids, come after them); the file is still one a
    safetensors reader loads, with no gaps between tensors."""
    from safetensors.numpy import load_file

    big = {"tokens": ("I32", np.arange(7, dtype="<i4")),  # 28 bytes: not a multiple of 64
           "0.keys": ("F16", np.arange(2 * 7 * 32, dtype="<f2").reshape(1, 2, 7, 32)),  # rows of 64 bytes
           "0.values": ("F32", np.ones((1, 2, 7, 16), dtype="<f4"))}
    blobwrite.write(tmp_path, H, big, {"hash": H.hex(), "kind": "0"}, fsync=False)
    buf = blobtree.blob_path(tmp_path, H).read_bytes()
    header, base = blobformat.parse_header(buf)
    assert base % blobformat.ALIGN == 0
    for name in ("0.keys", "0.values"):
        assert (base + header[name]["data_offsets"][0]) % blobformat.ALIGN == 0, name
    spans = sorted(tuple(header[name]["data_offsets"]) for name in header)
    assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert spans[-1][1] == len(buf) - base
    loaded = load_file(str(blobtree.blob_path(tmp_path, H)))
    for name, (_, arr) in big.items():
        assert np.array_equal(loaded[name], arr), name


def test_verify_bytes_returns_entries_and_metadata(tmp_path):
    buf, _, _ = written(tmp_path)
    entries, meta = blobformat.verify_bytes(buf, H)
    assert set(entries) == set(tensors())
    assert entries["0.keys"]["shape"] == [1, 2, 7, 4] and entries["0.values"]["dtype"] == "BF16"
    assert meta["hash"] == H.hex() and meta["kind"] == "0"
    # a memoryview and a bytearray work alike (remote downloads hand either)
    assert blobformat.verify_bytes(memoryview(bytearray(buf)), H)[1] == meta


def test_verify_bytes_catches_a_byte_flipped_in_each_tensor(tmp_path):
    buf, _, _ = written(tmp_path)
    header, base = blobformat.parse_header(buf)
    for name, info in header.items():
        start, end = info["data_offsets"]
        if start == end:
            continue
        for at in (start, end - 1):
            bad = bytearray(buf)
            bad[base + at] ^= 0x40
            with pytest.raises(BlobError, match=repr(name)):
                blobformat.verify_bytes(bad, H)


def test_verify_bytes_refuses_other_records_and_damaged_headers(tmp_path):
    buf, _, _ = written(tmp_path)
    with pytest.raises(BlobError, match="names record"):
        blobformat.verify_bytes(buf, bytes(16))
    with pytest.raises(BlobError):
        blobformat.verify_bytes(buf[:-1], H)  # truncated: the last tensor's entry no longer fits
    with pytest.raises(BlobError):
        blobformat.verify_bytes(b"\xff" * 8 + buf[8:], H)  # impossible header length
    with pytest.raises(BlobError):
        blobformat.verify_bytes(b"", H)


def reencode(buf: bytes, **meta_changes) -> bytes:
    """The same tensors under a changed `__metadata__` (None deletes a key)."""
    header, base = blobformat.parse_header(buf)
    meta = blobformat.header_metadata(buf)
    for k, v in meta_changes.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    ts = {}
    for name, info in header.items():
        start, end = info["data_offsets"]
        np_dtype = blobformat.DTYPES[info["dtype"]]
        ts[name] = (info["dtype"], np.frombuffer(buf[base + start : base + end], np_dtype).reshape(info["shape"]))
    head, pieces = blobformat.encode(ts, meta)
    return head + b"".join(p.tobytes() for p in pieces)


def test_verify_bytes_refuses_a_blob_without_per_tensor_checksums(tmp_path):
    buf, _, _ = written(tmp_path)
    with pytest.raises(BlobError, match="no per-tensor checksums"):
        blobformat.verify_bytes(reencode(buf, checksums=None, blob_format=None), H)
    with pytest.raises(BlobError, match="lists no tensor checksums"):
        blobformat.verify_bytes(reencode(buf, checksums=None), H)
    with pytest.raises(BlobError, match="not JSON"):
        blobformat.verify_bytes(reencode(buf, checksums="{"), H)
    with pytest.raises(BlobError, match="16-hex-digit"):
        blobformat.verify_bytes(reencode(buf, checksums='{"tokens": 5}'), H)
    sums = json.loads(blobformat.header_metadata(buf)["checksums"])
    del sums["1.state"]
    with pytest.raises(BlobError, match="1.state"):
        blobformat.verify_bytes(reencode(buf, checksums=json.dumps(sums)), H)
    sums["1.state"], sums["ghost"] = "0" * 16, "0" * 16
    with pytest.raises(BlobError, match="ghost"):
        blobformat.verify_bytes(reencode(buf, checksums=json.dumps(sums)), H)


# -- stores written by 0.1 ------------------------------------------------------------------------

def stage_v01(root: Path, h: bytes, tensors, metadata, *, fsync: bool = True, trust=None) -> blobwrite.Staged:
    """`blobwrite.stage` (the writer's first half of `blobwrite.write`) as kvstore 0.1 wrote blobs: the
    safetensors header carries only the writer's own metadata (no `blob_format`, no
    `checksums`); the row's checksum is xxh3_64 of the whole file."""
    path = blobtree.blob_path(root, h)
    blobwrite._makedirs(path.parent)
    head, pieces = blobformat.encode(tensors, metadata)
    data = head + b"".join(p.tobytes() for p in pieces)
    tmp = path.parent / f"{blobtree.TMP_PREFIX}{h.hex()}.{os.getpid()}.{os.urandom(4).hex()}"
    with open(tmp, "wb") as f:
        f.write(data)
        if fsync:
            os.fsync(f.fileno())
    return blobwrite.Staged(tmp, path, len(data), xxhash.xxh3_64_intdigest(data), fsync)


@pytest.fixture(scope="module")
def store_v01(tmp_path_factory, demo_model):
    """A store whose every blob is in the exact 0.1 format, holding one 80-token prompt of the
    tiny llama demo model (chunk size 16: five chunks) and its tail-less end."""
    from kvtest import prefill
    from mlx_lm import load

    model_dir = demo_model("llama")
    model, _ = load(str(model_dir))
    root = tmp_path_factory.mktemp("store-v01") / "s"
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 250, 85)]
    mp = pytest.MonkeyPatch()
    mp.setattr(blobwrite, "stage", stage_v01)
    try:
        with kvstore.open(root, chunk_size=16, memory_bytes=0) as store:
            mc = store.bind(model, str(model_dir))
            mc.insert(tokens, prefill(model, tokens))
            store.flush()
    finally:
        mp.undo()
    files = [p for p in blobtree.walk(root / "blobs") if p.name.endswith(blobtree.SUFFIX)]
    assert files
    for p in files:  # really the 0.1 format
        meta = blobformat.header_metadata(p.read_bytes())
        assert "checksums" not in meta and "blob_format" not in meta
    return root, model_dir, tokens


def run_check(store, model_dir, tokens, **extra):
    cmd = [sys.executable, str(HERE / "procs.py"), "check", str(store), str(model_dir), "16",
           json.dumps(tokens), json.dumps({"memory_bytes": 0, **extra})]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_store_written_by_01_restores_exactly_in_a_fresh_process(store_v01):
    root, model_dir, tokens = store_v01
    got = run_check(root, model_dir, tokens + [7, 8, 9])
    assert got["reused"] == len(tokens)
    assert got["max_abs_diff"] <= 1e-4 and got["greedy"] == got["greedy_ref"]
    branch = run_check(root, model_dir, tokens[:40] + [1, 2, 3])
    assert branch["reused"] == 40
    assert branch["max_abs_diff"] <= 1e-4 and branch["greedy"] == branch["greedy_ref"]


def test_a_damaged_01_blob_is_still_caught_by_its_whole_file_checksum(store_v01, tmp_path):
    import shutil

    root, model_dir, tokens = store_v01
    copy = tmp_path / "s"
    shutil.copytree(root, copy)
    # Flip one payload byte in the blob of the third chunk: the prefix ends at 32 tokens.
    files = {blobtree.hash_of(p): p for p in blobtree.walk(copy / "blobs") if blobtree.hash_of(p)}
    metas = {h: blobformat.header_metadata(p.read_bytes()) for h, p in files.items()}
    third = next(h for h, m in metas.items() if m.get("depth") == "3" and m.get("kind") == "0")
    raw = bytearray(files[third].read_bytes())
    raw[-3] ^= 0x01
    files[third].write_bytes(bytes(raw))
    got = run_check(copy, model_dir, tokens + [7])
    assert got["reused"] == 32
    assert got["max_abs_diff"] <= 1e-4 and got["greedy"] == got["greedy_ref"]


def test_a_header_changed_in_place_after_it_was_parsed_is_parsed_again(tmp_path):
    # Parsed headers are reused by (device, inode, size) only while their bytes are unchanged:
    # a header damaged in place (same file, same size) must be refused, not served from memory.
    buf, size, checksum = written(tmp_path)
    with blobfile.open_blob(tmp_path, H, size=size) as blob:
        assert blob.array("0.keys").tobytes() == tensors()["0.keys"][1].tobytes()
    with blobfile.open_blob(tmp_path, H, size=size) as again:  # the kept parse, same tensor table
        assert again.layout is blob.layout
    path = blobtree.blob_path(tmp_path, H)
    (n,) = struct.unpack_from("<Q", buf, 0)
    at = buf.index(b'"hash":"') + len(b'"hash":"')
    with open(path, "r+b") as f:  # another record's hash, same length: only the header knows
        f.seek(at)
        f.write(b"f" if buf[at:at + 1] != b"f" else b"e")
    assert at < 8 + n and path.stat().st_size == size
    with pytest.raises(BlobError, match="names record"):
        blobfile.open_blob(tmp_path, H, size=size)


def test_read_copies_reuses_its_plan_and_still_checks_every_tensor(tmp_path):
    from kvstore.restore.plan import Copy

    buf, size, _ = written(tmp_path)
    keys = tensors()["0.keys"][1]
    copies = (Copy(0, "0.keys", 2, 7, 1),)
    out = np.zeros((1, 2, 9, 4), dtype="<f4")
    targets = {"0.keys": readplan.target(out)}
    for _ in range(2):  # the second read takes the read plan kept for this copies tuple
        out[:] = 0
        with blobfile.open_blob(tmp_path, H, size=size) as blob:
            blob.read_copies(copies, targets)
        assert np.array_equal(out[:, :, 1:6], keys[:, :, 2:7]) and not out[:, :, 6:].any()
    header, base = blobformat.parse_header(buf)
    start = base + header["0.keys"]["data_offsets"][0]
    path = blobtree.blob_path(tmp_path, H)
    with open(path, "r+b") as f:  # a byte of a token outside the copied range: still checked
        f.seek(start)
        f.write(bytes([buf[start] ^ 1]))
    with blobfile.open_blob(tmp_path, H, size=size) as blob, pytest.raises(BlobError, match="checksum"):
        blob.read_copies(copies, targets)


@pytest.mark.skipif(not hasattr(os, "RWF_NOWAIT") or not hasattr(os, "posix_fadvise"), reason="Linux only")
def test_prefetch_asks_for_readahead_only_when_a_blob_has_left_the_page_cache(tmp_path, monkeypatch):
    # prefetch skips the per-file fadvise calls when the chain's last and first blob are cached,
    # and asks for every file once the last one is evicted. Asked: which files it advised.
    hashes = [bytes([k]) * 16 for k in range(3)]
    for h in hashes:
        blobwrite.write(tmp_path, h, tensors(), {"hash": h.hex(), "kind": "0"}, fsync=False)
        blobtree.blob_path(tmp_path, h).read_bytes()  # into the page cache
    advised = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, *a: (advised.append(os.fstat(fd).st_ino), real(fd, *a)))
    blobfile.prefetch(tmp_path, hashes)
    assert advised == []
    last = blobtree.blob_path(tmp_path, hashes[-1])
    with open(last, "rb") as f:
        os.fsync(f.fileno())
        real(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
    # No look at the page cache in between: a read that misses it (RWF_NOWAIT) may start the
    # kernel's readahead, which puts the file back before prefetch looks.
    blobfile.prefetch(tmp_path, hashes)
    if not advised and blobfile._cached(tmp_path, hashes[-1]):
        pytest.skip("this filesystem keeps the file in the page cache despite DONTNEED")
    inodes = {blobtree.blob_path(tmp_path, h).stat().st_ino for h in hashes}
    assert set(advised) == inodes


def _record_blob(tmp_path, **extra) -> bytes:
    meta = {"hash": H.hex(), "ns": "11" * 16, "parent": "22" * 16, "depth": "3", "kind": "1", **extra}
    blobwrite.write(tmp_path, H, tensors(), meta, fsync=False)
    return blobtree.blob_path(tmp_path, H).read_bytes()


def test_one_reader_gives_the_record_its_header_names_its_tokens_and_entries(tmp_path):
    stored = blobformat.read_record(_record_blob(tmp_path))
    rid = stored.identity
    assert (rid.hash, rid.ns, rid.parent, rid.depth, rid.kind) == (H, b"\x11" * 16, b"\x22" * 16, 3, 1)
    assert rid.ntokens == 7 and rid.first_token == 0 and stored.tokens.tolist() == list(range(7))
    assert set(stored.entries) == set(tensors()) and stored.extensions == {}
    with blobfile.open_blob(tmp_path, H, size=len(_record_blob(tmp_path))) as blob:  # the disk tier's read
        assert blob.tokens().tolist() == list(range(7))
    blobwrite.write(tmp_path, H, {k: v for k, v in tensors().items() if k != "tokens"}, {"hash": H.hex()}, fsync=False)
    with pytest.raises(BlobError, match="no int32 token ids"):
        blobformat.read_record(blobtree.blob_path(tmp_path, H).read_bytes())


def test_the_header_extension_point_adds_a_checked_field_and_leaves_other_blobs_as_they_were(tmp_path):
    plain = _record_blob(tmp_path)
    assert not [k for k in blobformat.header_metadata(plain) if k.startswith("x-")]

    def canary(text: str) -> bytes:
        if len(text) != 16:
            raise ValueError("not 16 hex digits")
        return bytes.fromhex(text)

    blobformat.register_extension("testcanary", canary)
    try:
        with pytest.raises(ValueError, match="registered already"):
            blobformat.register_extension("testcanary", lambda t: t)
        with pytest.raises(ValueError, match="no blob header extension"):
            blobformat.with_extensions({}, {"unknown": "x"})
        meta = blobformat.with_extensions({}, {"testcanary": "00ff" * 4})
        buf = _record_blob(tmp_path, **meta, **{"x-someone-else": "kept, not read"})
        stored = blobformat.read_record(buf)
        assert stored.extensions == {"testcanary": bytes.fromhex("00ff" * 4)}
        assert stored.identity.hash == H
        assert blobformat.read_record(plain).tokens.tolist() == stored.tokens.tolist()  # old blobs read alike
        bad = _record_blob(tmp_path, **{"x-testcanary": "short"})
        with pytest.raises(BlobError, match="x-testcanary"):  # every reader: whole bytes, and a file
            blobformat.read_record(bad)
        with pytest.raises(BlobError, match="x-testcanary"):
            blobfile.open_blob(tmp_path, H, size=len(bad))
    finally:
        blobformat._EXTENSIONS.pop("testcanary", None)


def test_a_record_altered_with_its_checksums_fixed_is_refused_by_its_trust_tag(tmp_path, llama):
    """A writer of the store folder scales a chunk's keys and writes their checksum (and the row's)
    to match: no checksum sees it, but its header's trust tag (under the store's own key) no longer
    holds. verify reports it; a fetch never restores it (the prefix ends before it, quarantined)."""
    from kvtest import alter_record, logits_diff, prefill

    path, model = llama
    c = 16
    prompt = [int(t) for t in np.random.default_rng(11).integers(1, 250, 3 * c + 5)]
    with kvstore.open(tmp_path / "s", chunk_size=c) as store:
        mc = store.bind(model, path)
        mc.insert(prompt, prefill(model, prompt))
        store.flush()
        second = mc.record_hashes(prompt)[1]
    alter_record(tmp_path / "s", second, "1.keys", 1.5)
    with kvstore.open(tmp_path / "s", chunk_size=c, memory_bytes=0) as store:
        problems = store.verify()  # it, and what hangs below it
        damaged = [p for p in problems if p.kind == "corrupt_blob"]
        assert [p.hash for p in damaged] == [second.hex()] and "trust tag does not hold" in damaged[0].detail
        assert {p.kind for p in problems} == {"corrupt_blob", "orphan_row"}, problems
        query = prompt + [7]
        cache, rest = store.bind(model, path).fetch(query)
        assert len(query) - len(rest) == c and logits_diff(model, cache, rest, query) < 1e-4
        assert store.index.get(second).bad
