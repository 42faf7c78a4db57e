"""K/V quantized on disk (`disk_kv_bits`): restored from a fresh process to the model's own cache
class, dtype and room, with logits within the measured bound of a recompute; never mixed with an
unquantized store's records; remembered across restarts; stores without it unchanged; checksums
still guard what is on disk; bad values refused."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache
from test_restore import insert, run, toks  # insert here, check in a fresh process (restore_proc.py); random ids

import kvstore
from kvstore.errors import InvalidInputError
from kvstore.storage import blobformat, blobtree

C = 16  # chunk size of every store here (restore_proc.C)
# Largest |logit - recompute| on the demo models, bench/kv8.py: 0.094 at 8 bits, 0.91 at 4 bits
# (bf16 logits near 8 are 0.0625 apart). The bounds leave room for other seeds.
BOUND = {8: 0.25, 4: 1.5}


def prefill(model, tokens):
    cache = make_prompt_cache(model)
    model(mx.array([tokens]), cache=cache)
    mx.eval([c.state for c in cache])
    return cache


CASES = {  # name -> (demo arch, dtype, bits, tier)
    "kv-bf16-disk": ("llama", "bfloat16", 8, "disk"),
    "kv-bf16-memory": ("llama", "bfloat16", 8, "memory"),
    "kv-bf16-pending": ("llama", "bfloat16", 8, "pending"),
    "kv-f16-disk": ("llama", "float16", 8, "disk"),
    "kv-4bit-disk": ("llama", "bfloat16", 4, "disk"),
    "sliding-window-disk": ("gemma3_text", "bfloat16", 8, "disk"),
    "hybrid-f16-disk": ("qwen3_5", "float16", 8, "disk"),
}


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """`plain(model_dir, tokens)`: a store without `disk_kv_bits` holding the prompt, inserted (here)
    once per model and prompt, four cases share llama bfloat16's; each case restores it from disk
    in its own checking process, after its quantized store."""
    done: dict[tuple[str, tuple[int, ...]], Path] = {}

    def get(model_dir: Path, tokens: list[int]) -> Path:
        key = (str(model_dir), tuple(tokens))
        if key not in done:
            store = tmp_path_factory.mktemp("plain") / "s"
            insert(store, model_dir, {}, tokens)
            done[key] = store
        return done[key]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_restored_caches_are_the_models_own_within_the_bound(tmp_path, demo_model, plain, case):
    arch, dtype, bits, tier = CASES[case]
    model_dir = demo_model(arch, "small", dtype)  # head_dim 32: group size 32
    tokens = toks(4 * C + 6, 3) + [7]
    spec = {"disk_kv_bits": bits}
    if tier == "disk":
        insert(tmp_path / "q", model_dir, spec, tokens)
    # The quantized store from `tier`, then an unquantized one from disk, in one fresh process.
    stores = [{"store": str(tmp_path / "q"), "spec": spec, "tier": tier},
              {"store": str(plain(model_dir, tokens)), "spec": {}, "tier": "disk"}]
    got, unquantized = run("checks", json.dumps(stores), model_dir, spec, tokens, tier)
    assert got["reused"] == len(tokens) - 1
    assert 0 < got["max_abs_diff"] <= BOUND[bits], got["max_abs_diff"]  # lossy, but close
    assert all(got["in_place"])  # the first step wrote into the restored arrays' spare room
    assert [r["capacity"] for r in got["after"]] == [r["capacity"] for r in got["before"]]
    # Exactly what an unquantized store restores: classes, dtype, capacity, offset, window index.
    assert unquantized["reused"] == got["reused"]
    assert got["classes"] == unquantized["classes"] and got["before"] == unquantized["before"]
    assert {r["dtype"] for r in got["before"]} == {f"mlx.core.{dtype}"}
    if tier == "memory":
        assert got["memory_hits"] > 0
    if tier == "pending":
        assert got["pending_bytes"] > 0


def test_greedy_tokens_agree_with_a_recompute_at_8_bits(tmp_path, demo_model):
    model_dir = demo_model("llama", "small", "bfloat16")
    tokens = toks(4 * C + 6, 5) + [9]
    insert(tmp_path / "q", model_dir, {"disk_kv_bits": 8}, tokens)
    got = run("check", tmp_path / "q", model_dir, {"disk_kv_bits": 8}, tokens)
    assert got["greedy"] == got["greedy_ref"]


def _models(store_dir: Path) -> list[dict]:
    with kvstore.open(store_dir, chunk_size=C, create=False) as store:
        return store.stats()["models"]


def test_a_quantized_and_a_bf16_store_in_one_directory_never_serve_each_others_records(tmp_path, demo_model):
    from mlx_lm import load

    model_dir = demo_model("llama", "small", "bfloat16")
    model, _ = load(str(model_dir))
    tokens = toks(3 * C + 5, 7)
    exact = prefill(model, tokens)
    query = tokens + [3]

    def fetched(bits):
        with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0, disk_kv_bits=bits) as store:
            cache, rest = store.bind(model, model_dir).fetch(query)
            return cache, len(query) - len(rest)

    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0, disk_kv_bits=8) as store:
        store.bind(model, model_dir).insert(tokens, exact)
    assert fetched(0)[1] == 0  # the bf16 namespace holds nothing yet
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0, disk_kv_bits=0) as store:
        store.bind(model, model_dir).insert(tokens, exact)
    n = len(tokens)
    for bits, lossless in ((8, False), (0, True), (8, False)):
        cache, reused = fetched(bits)
        assert reused == n
        for mine, want in zip(cache, exact):
            diff = float(mx.abs(mine.keys[:, :, :n] - want.keys[:, :, :n]).max())
            assert (diff == 0) == lossless, (bits, diff)
            assert diff < 0.1
    models = _models(tmp_path / "s")
    assert len(models) == 2 and len({m["namespace"] for m in models}) == 2
    # `kvstore stats` shows both with one fingerprint: its rows say which is the 8-bit one.
    out = subprocess.run([sys.executable, "-m", "kvstore.cli", "stats", "--store", str(tmp_path / "s")],
                         capture_output=True, text=True, timeout=120).stdout
    rows = [line for line in out.splitlines() if line.rstrip().endswith(str(model_dir)) or "(K/V" in line]
    assert sorted(r.endswith("(K/V 8-bit, on disk)") for r in rows) == [False, True], out


def test_the_setting_survives_a_restart_and_0_turns_it_off(tmp_path, demo_model):
    model_dir = demo_model("llama", "small", "bfloat16")
    tokens = toks(4 * C + 6, 11) + [5]
    insert(tmp_path / "s", model_dir, {"disk_kv_bits": 8}, tokens)
    got = run("check", tmp_path / "s", model_dir, {}, tokens)  # a fresh process, setting not given
    assert got["reused"] == len(tokens) - 1 and 0 < got["max_abs_diff"] <= BOUND[8]
    for options in ({}, {"read_only": True}):
        with kvstore.open(tmp_path / "s", chunk_size=C, **options) as store:
            assert store.disk_kv_bits == 8 and store.stats()["disk_kv_bits"] == 8
    with kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=0) as store:
        assert store.disk_kv_bits is None
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        assert store.disk_kv_bits is None
    assert run("check", tmp_path / "s", model_dir, {}, tokens)["reused"] == 0


def test_a_store_without_the_setting_is_unchanged(tmp_path, demo_model):
    from mlx_lm import load

    model_dir = demo_model("llama", "small", "bfloat16")
    model, _ = load(str(model_dir))
    tokens = toks(2 * C + 3, 2)
    with kvstore.open(tmp_path / "s", chunk_size=C) as store:
        mc = store.bind(model, model_dir)
        assert store.disk_kv_bits is None
        # The layout (and so the namespace) a store had before disk_kv_bits existed.
        assert mc.layout == {"layers": [{"class": "KVCache"}] * 4, "param_dtypes": ["mlx.core.bfloat16"]}
        mc.insert(tokens, prefill(model, tokens))
        ns = mc.ns
    with sqlite3.connect(tmp_path / "s" / "index.sqlite") as conn:  # opening wrote no setting
        assert conn.execute("SELECT count(*) FROM meta WHERE key LIKE 'setting.%'").fetchone() == (0,)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        mc = store.bind(model, model_dir)
        _, rest = mc.fetch(tokens + [1])
        assert mc.ns == ns and len(rest) == 1


@pytest.mark.parametrize("size, dtype, why", [
    ("tiny", "bfloat16", "its bf16/f16 K/V have a head_dim of 16, which neither 64 nor 32"),
    ("small", "float32", "none of its attention layers holds bf16 or f16 K/V (its parameters are mlx.core.float32)")])
def test_layers_that_cannot_be_quantized_are_stored_as_before(tmp_path, demo_model, caplog, size, dtype, why):
    # tiny: head_dim 16, which neither 64 nor 32 divides; float32: not a bf16/f16 cache. Nothing
    # is quantized, so the namespace is the unquantized store's (their records are the same bytes),
    # and the warning gives the reason that holds (not "no bf16 K/V" for a bf16 model).
    from mlx_lm import load

    model_dir = demo_model("llama", size, dtype)
    model, _ = load(str(model_dir))
    namespaces = []
    for bits in (8, 0):
        with caplog.at_level("WARNING", logger="kvstore"), \
                kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=bits) as store:
            mc = store.bind(model, model_dir)
            assert all("disk_bits" not in layer for layer in mc.layout["layers"])
            namespaces.append(mc.ns)
    assert namespaces[0] == namespaces[1]
    said = [r.getMessage() for r in caplog.records if "has no effect on this model" in r.getMessage()]
    assert len(said) == 1 and why in said[0], said


def test_caches_mlx_lm_quantizes_bind_whatever_their_group_size(tmp_path, demo_model, caplog):
    # kv_bits (serve --kv-bits 8, whose --kv-group-size is 64) on a head_dim of 32: disk_kv_bits
    # has no effect on QuantizedKVCache layers, so it must not refuse the bind where a store
    # without it binds (it ran the model into the quantized caches and failed, and serve then
    # stored nothing, saying "open the store with disk_kv_bits=0").
    from mlx_lm import load

    model_dir = demo_model("llama", "small", "bfloat16")  # head_dim 32
    model, _ = load(str(model_dir))
    namespaces = []
    for bits in (8, 0):
        with caplog.at_level("WARNING", logger="kvstore"), \
                kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=bits) as store:
            mc = store.bind(model, model_dir, kv_bits=8, kv_group_size=64)
            assert mc.layout["layers"] == [{"class": "QuantizedKVCache", "group_size": 64, "bits": 8}] * 4
            namespaces.append(mc.ns)
    assert namespaces[0] == namespaces[1]
    said = [r.getMessage() for r in caplog.records if "has no effect on" in r.getMessage()]
    # (not "on this model": kvstore serve --kv-bits stores its prompt caches before mlx-lm
    # quantizes them, through a plain bind, where disk_kv_bits does act)
    assert said == ["kvstore: disk_kv_bits=8 has no effect on the caches mlx-lm quantizes (kv_bits=8): their "
                    "K/V are stored as they are"], said
    with kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=8) as store:
        assert store.bind(model, model_dir).layout["layers"][0]["disk_bits"] == 8
    # Under a disk budget too: the record shapes cannot be traced into those caches (mlx's
    # quantize refuses the group), which is said, and the bind still serves (it raised AttributeError).
    with kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=8, max_bytes="1GiB") as store:
        mc = store.bind(model, model_dir, kv_bits=8, kv_group_size=64)
        cache, rest = mc.fetch(toks(2 * C, 4))
        assert len(rest) == 2 * C and type(cache[0]).__name__ == "QuantizedKVCache"


def test_a_damaged_quantized_tensor_is_never_served(tmp_path, demo_model):
    from mlx_lm import load

    model_dir = demo_model("llama", "small", "bfloat16")
    model, _ = load(str(model_dir))
    tokens = toks(3 * C + 6, 13)
    with kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=8) as store:
        store.bind(model, model_dir).insert(tokens, prefill(model, tokens))
        store.flush()
        target = next(r for r in store.index.rows() if r.depth == 2 and r.kind == 0)
    blob = blobtree.blob_path(tmp_path / "s" / "blobs", target.hash)
    raw = bytearray(blob.read_bytes())
    header, base = blobformat.parse_header(bytes(raw))
    assert {"0.keys.q", "0.keys.scales", "0.keys.biases", "0.values.q"} <= set(header)
    assert "0.keys" not in header and header["0.keys.q"]["dtype"] == "U32"
    start, end = header["0.values.scales"]["data_offsets"]
    raw[base + (start + end) // 2] ^= 0x10
    blob.write_bytes(bytes(raw))
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        _, rest = store.bind(model, model_dir).fetch(tokens + [5])
        assert len(tokens) + 1 - len(rest) == C  # the prefix ends where the damaged record starts
        assert store.counters["quarantined"] == 1


def test_records_are_the_same_whether_inserted_at_once_or_chunk_by_chunk(tmp_path, demo_model):
    # An insert quantizes only the tokens of its new records; each token is quantized on its own.
    from mlx_lm import load

    model_dir = demo_model("llama", "small", "bfloat16")
    model, _ = load(str(model_dir))
    tokens = toks(4 * C + 3, 17)
    restored = []
    for name, step in (("once", None), ("steps", C)):
        with kvstore.open(tmp_path / name, chunk_size=C, memory_bytes=0, disk_kv_bits=8) as store:
            mc = store.bind(model, model_dir)
            mc.prefill(tokens, step=step or len(tokens))
            store.flush()
            cache, rest = mc.fetch(tokens + [2])
            assert len(rest) == 1
            restored.append(cache)
    for a, b in zip(*restored):
        assert mx.array_equal(a.keys, b.keys) and mx.array_equal(a.values, b.values)


def test_bad_values_are_refused_with_a_clear_error(tmp_path, caplog):
    for bad in (3, 16, 1, -8, True, "3", 8.5):
        with pytest.raises(InvalidInputError, match="disk_kv_bits: must be one of 4, 8"):
            kvstore.open(tmp_path / "s", disk_kv_bits=bad)
    with kvstore.open(tmp_path / "s", disk_kv_bits=4) as store:
        assert store.disk_kv_bits == 4
    with sqlite3.connect(tmp_path / "s" / "index.sqlite") as conn:
        conn.execute("UPDATE meta SET value = '5' WHERE key = 'setting.disk_kv_bits'")
    (tmp_path / "s" / "index.settings").unlink()  # (a right copy beside the index would be read instead)
    with caplog.at_level("WARNING", logger="kvstore"), kvstore.open(tmp_path / "s") as store:
        assert store.disk_kv_bits is None  # a damaged kept value opens with the default, said once
        assert store.stats()["settings"]["disk_kv_bits"] == {"value": None, "source": "default"}
    assert [r for r in caplog.records if "kept disk_kv_bits '5' is damaged" in r.getMessage()]
    for argv in (["generate", "--disk-kv-bits", "3", "hi"], ["serve", "--disk-kv-bits", "16"]):
        out = subprocess.run([sys.executable, "-m", "kvstore.cli", *argv], capture_output=True, text=True, timeout=120)
        assert out.returncode == 2 and "--disk-kv-bits: must be one of 4, 8" in out.stderr, out.stderr


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("bits", [8, 4])
def test_a_round_trip_at_real_head_sizes(tmp_path, head_dim, bits):
    """Real models' head_dim (64, 128, 256) holds one to four groups of 64 per row: a decode that
    mixes up groups and group size passes at the demo models' head_dim 32 (one group) and
    restores nothing, or garbage, here. Bounds: about one quantization step (bench/kv8.py)."""
    from mlx_lm.models import llama

    args = llama.ModelArgs(model_type="llama", hidden_size=128, num_hidden_layers=2, intermediate_size=256,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=head_dim,
                           rms_norm_eps=1e-5, vocab_size=256)
    model = llama.Model(args)
    model.set_dtype(mx.bfloat16)
    tokens = toks(2 * C + 8, head_dim + bits)
    exact = prefill(model, tokens)
    with kvstore.open(tmp_path / "s", chunk_size=C, disk_kv_bits=bits) as store:
        mc = store.bind(model, f"head-dim-{head_dim}", fingerprint=bytes(16))
        assert [layer["disk_group_size"] for layer in mc.layout["layers"]] == [64, 64]
        mc.insert(tokens, exact)
    with kvstore.open(tmp_path / "s", chunk_size=C, memory_bytes=0) as store:
        cache, rest = store.bind(model, f"head-dim-{head_dim}", fingerprint=bytes(16)).fetch(tokens + [1])
    assert len(rest) == 1
    for mine, want in zip(cache, exact):
        for got, ref in ((mine.keys, want.keys), (mine.values, want.values)):
            got, ref = got[..., : len(tokens), :].astype(mx.float32), ref[..., : len(tokens), :].astype(mx.float32)
            assert got.shape == ref.shape and mine.keys.dtype == mx.bfloat16
            rel = float(mx.abs(got - ref).max() / mx.abs(ref).max())
            assert 0 < rel <= {8: 1 / 64, 4: 1 / 6}[bits], rel


def test_the_bucket_holds_the_quantized_records_and_serves_them_to_a_node_of_the_same_width(
        tmp_path, s3, demo_model):
    # What goes up with disk_kv_bits=8 is the 8-bit record, the bytes on disk (0.72x of bf16
    # here, in 16-token records, where uploads of bf16 records would be 1.0x); a fresh node of the
    # same width restores it from the bucket to the model's own bf16 KVCache within the bound; a
    # node at 0 bits restores nothing of it (another namespace) and computes the prompt.
    from kvtest import logits_diff
    from mlx_lm import load

    from kvstore.remote.s3 import S3Bucket

    model_dir = demo_model("llama", "small", "bfloat16")
    model, _ = load(str(model_dir))
    tokens = toks(5 * C + 7, 3)

    def node(name, url, bits):
        return kvstore.open(tmp_path / name, chunk_size=C, remote=url, disk_kv_bits=bits,
                            remote_prefetch="wait_complete", memory_bytes=0)

    sent = {}
    for bits in (0, 8):
        url = s3.url()
        with node(f"a{bits}", url, bits) as a:
            a.bind(model, model_dir).insert(tokens, prefill(model, tokens))
            assert a.flush(timeout=30) and a.stats()["remote"]["uploads"] == 6
            on_disk = a.stats()["bytes"]
        sent[bits] = sum(size for _, size, _ in S3Bucket(url).list(""))
        # The disk's records, sealed (without the node's own header fields), and a manifest.
        assert 0.9 * on_disk < sent[bits] < 1.1 * on_disk, (bits, on_disk, sent[bits])
        if bits == 8:
            with node("b8", url, 8) as b:
                mc = b.bind(model, model_dir)
                cache, rest = mc.fetch(tokens + [5])
                assert len(rest) == 1 and b.stats()["remote"]["remote_tokens"] == len(tokens)
                assert type(cache[0]).__name__ == "KVCache" and cache[0].keys.dtype == mx.bfloat16
                assert logits_diff(model, cache, rest, tokens + [5]) < BOUND[8]
            with node("b0", url, 0) as b:
                _, rest = b.bind(model, model_dir).fetch(tokens + [5])
                assert len(rest) == len(tokens) + 1
    assert sent[8] < 0.8 * sent[0], sent  # (16-token records: their headers weigh more than at 256)
