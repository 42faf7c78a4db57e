"""KV packs (`kvstore pack`): their size per token, and what an import costs against a raw read.

    python bench/packs.py [--tokens 2048] [--reps 3] [--weights-mb 512]

1. Sizes: a pack of one 2,048-token prompt per model shape, at bf16 and with `disk_kv_bits=8`
   (blob bytes per token, whole pack included, and the 8-bit/bf16 ratio). Real shapes (Qwen3-0.6B,
   Qwen3-4B, Llama-3-8B: every layer, 8 kv heads, head_dim 128) are random bf16 K/V inserted
   through `bench/common.ShapeModel`; the demo model is the built-in one (small, bf16).
2. Import of the Qwen3-0.6B-shaped 2,048-token pack (bf16), page cache warm, its model folder
   holding a generated weight file of `--weights-mb` MB (random bytes: the shape model computes
   nothing, but an import hashes the weights): a raw read of the pack's files into memory,
   SHA-256 and xxh3 over those bytes, the model's files hashed (SHA-256 and xxh3 in one read),
   the checks alone (`packs.verify`, hashing the weights too), the whole import into a fresh
   store (the weights hashed, checks, then blobs fsynced and rows) and into a store that has
   hashed the model before (its memo holds the weights' digests), each the median of `--reps`
   runs, side by side in one process; page faults per import.
3. The demo model end to end: the prefill a pack saves (the export computes the prompt cold), the
   pack's bytes, the import, and the first request after it (tokens reused, time to first token
   against the cold prefill). Run with OpenBLAS preloaded for prefill numbers that mean anything.

Writes bench/results/packs.json and prints the tables (bench/README.md's "KV packs" section,
from report_sections.packs). Nothing here is a test.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import statistics
import time
import types
from pathlib import Path

import common as C
import mlx.core as mx
import numpy as np
import report_sections
import xxhash

import kvstore
from kvstore.demo import build_demo_model
from kvstore.packs import identity
from kvstore.packs.export import export_pack
from kvstore.packs.importing import import_pack
from kvstore.packs.verify import Target, verify

REAL = {"qwen3-0.6b": C.Shape("qwen3-0.6b", 28, 8, 128), "qwen3-4b": C.Shape("qwen3-4b", 36, 8, 128),
        "llama-3-8b": C.Shape("llama-3-8b", 32, 8, 128)}
NO_TEMPLATE = types.SimpleNamespace(chat_template=None)


def shape_folder(root: Path, shape: C.Shape, weight_bytes: int = 64) -> Path:
    """A model folder for a ShapeModel: config.json and a weights file of `weight_bytes` random
    bytes, which its fingerprint and the pack's SHA-256s cover (the shape model computes nothing)."""
    folder = root / f"model-{shape.name}"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"shape": shape.name, "layers": shape.layers}))
    weights = np.random.default_rng(0).integers(0, 256, weight_bytes, dtype=np.uint8)
    mx.save_safetensors(str(folder / "model.safetensors"), {"w": mx.array(weights)})
    return folder


def shape_pack(root: Path, shape: C.Shape, tokens: int, bits: int | None,
               weight_bytes: int = 64) -> tuple[Path, Path]:
    """(pack folder, model folder) of `tokens` random tokens of `shape`, stored at `bits`."""
    folder = root / f"model-{shape.name}"
    if not folder.exists():
        folder = shape_folder(root, shape, weight_bytes)
    model = shape.model()
    toks = C.random_tokens(tokens)
    name = f"{shape.name}-{bits or 16}"
    with kvstore.open(root / f"store-{name}", disk_kv_bits=bits or 0) as store:
        mc = store.bind(model, str(folder))
        mc.insert(toks, C.random_cache(shape, tokens), durable=True)
        store.flush()
        export_pack(store, mc, folder, NO_TEMPLATE, [toks], root / f"pack-{name}")
    return root / f"pack-{name}", folder


def pack_bytes(pack: Path) -> tuple[int, int]:
    """(bytes of its blobs, bytes of the whole folder)."""
    blobs = sum(p.stat().st_size for p in (pack / "blobs").iterdir())
    return blobs, blobs + sum(p.stat().st_size for p in pack.iterdir() if p.is_file())


def sizes(root: Path, tokens: int, weight_bytes: int) -> list[dict]:
    rows = []
    for shape in REAL.values():
        row = {"model": shape.name, "layers": shape.layers, "kv_heads": shape.kv_heads, "head_dim": shape.head_dim}
        for bits in (None, 8):  # the Qwen3-0.6B shape's folder is the import's: realistic weights
            pack, _ = shape_pack(root, shape, tokens, bits, weight_bytes if shape.name == "qwen3-0.6b" else 64)
            blobs, whole = pack_bytes(pack)
            row[f"bytes_per_token_{bits or 16}"] = whole / tokens
            row[f"pack_bytes_{bits or 16}"] = whole
            if shape.name != "qwen3-0.6b":
                shutil.rmtree(pack)
        row["ratio_8"] = row["pack_bytes_8"] / row["pack_bytes_16"]
        rows.append(row)
        C.log(f"{shape.name}: {row['bytes_per_token_16']:.0f} B/token bf16, {row['bytes_per_token_8']:.0f} at 8 bits "
              f"({row['ratio_8']:.3f}x)")
    return rows


def import_speed(root: Path, reps: int) -> dict:
    """The Qwen3-0.6B-shaped bf16 pack: raw read, hashes, checks alone, whole import."""
    shape = REAL["qwen3-0.6b"]
    pack, folder = root / "pack-qwen3-0.6b-16", root / "model-qwen3-0.6b"
    files = sorted(p for p in pack.rglob("*") if p.is_file())
    nbytes = sum(p.stat().st_size for p in files)
    held: list[bytes] = []

    def raw() -> None:
        held[:] = [p.read_bytes() for p in files]

    def sha() -> None:
        for b in held:
            hashlib.sha256(b).digest()

    def xxh() -> None:
        for b in held:
            xxhash.xxh3_64_intdigest(b)

    def model_hash() -> None:
        identity.identity(folder, NO_TEMPLATE)

    model = shape.model()
    with kvstore.open(kvstore.MEMORY) as ram:
        mc = ram.bind(model, str(folder))
        target = Target(mc, folder, NO_TEMPLATE, None)

        def checks() -> None:
            verify(pack, target)

        runs = {"raw_read": [], "sha256": [], "xxh3": [], "model_hash": [], "checks": [], "import": [],
                "import_memo": []}
        faults = []
        for r in range(reps + 1):  # the first round warms the page cache and is not kept
            for name, fn in (("raw_read", raw), ("sha256", sha), ("xxh3", xxh), ("model_hash", model_hash),
                             ("checks", checks)):
                t = time.perf_counter()
                fn()
                if r:
                    runs[name].append(time.perf_counter() - t)
            dest, known = root / f"import-{r}", root / f"import-memo-{r}"
            with kvstore.open(known) as store:  # a store that has hashed the model (an earlier pack)
                identity.identity(folder, NO_TEMPLATE, identity.memo_of(store, remember=True))
            f0 = C.page_faults()[0]
            t = time.perf_counter()
            import_pack(pack, dest, model, str(folder), NO_TEMPLATE)
            took = time.perf_counter() - t
            f1 = C.page_faults()[0]
            t = time.perf_counter()
            import_pack(pack, known, model, str(folder), NO_TEMPLATE)
            if r:
                runs["import"].append(took)
                runs["import_memo"].append(time.perf_counter() - t)
                faults.append(f1 - f0)
            shutil.rmtree(dest)
            shutil.rmtree(known)
    out = {"bytes": nbytes, "files": len(files), "tokens": 2048,
           "weight_bytes": (folder / "model.safetensors").stat().st_size}
    for name, samples in runs.items():
        s = statistics.median(samples)
        out[name] = {"seconds": s, "gb_per_s": C.gbps(nbytes, s), "samples": samples}
    out["import_minor_faults"] = statistics.median(faults)
    out["pages"] = nbytes // 4096
    C.log(f"import of {nbytes / 1e6:.0f} MB: " + ", ".join(f"{k} {out[k]['gb_per_s']:.2f} GB/s" for k in runs))
    return out


def demo(root: Path, tokens: int) -> dict:
    """The demo model (small, bf16): prefill saved, pack bytes, import, first request after it."""
    from mlx_lm import load

    folder = build_demo_model(root / "demo", "llama", size="small", dtype="bfloat16")
    model, tokenizer = load(str(folder))
    toks = C.random_tokens(tokens, vocab=256)
    with kvstore.open(root / "demo-a") as store:
        mc = store.bind(model, str(folder))
        t = time.perf_counter()
        done = export_pack(store, mc, folder, tokenizer, [toks], root / "demo-pack")
        export_s = time.perf_counter() - t
    t = time.perf_counter()
    import_pack(root / "demo-pack", root / "demo-b", model, str(folder), tokenizer)
    import_s = time.perf_counter() - t
    with kvstore.open(root / "demo-b", memory_bytes=0) as store:
        mc = store.bind(model, str(folder))
        t = time.perf_counter()
        cache, rest = mc.fetch(toks)
        mx.eval(model(mx.array([rest]), cache=cache))
        warm_ttft = time.perf_counter() - t
    t = time.perf_counter()
    mx.eval(model(mx.array(toks)[None]))
    cold_ttft = time.perf_counter() - t
    _, whole = pack_bytes(root / "demo-pack")
    out = {"tokens": tokens, "computed_by_export": done.computed, "export_seconds": export_s, "pack_bytes": whole,
           "import_seconds": import_s, "reused_after_import": tokens - len(rest), "ttft_restored": warm_ttft,
           "ttft_cold": cold_ttft, "blas": C.blas_in_use()}
    # What the pack saves: the export's own prefill (in chunks, with its inserts) or one step of all
    # the tokens (mlx-lm's default prefill step is 2,048), whichever was quicker.
    out["prefill_seconds_saved_per_mb"] = (min(export_s, cold_ttft) - warm_ttft) / (whole / 1e6)
    C.log(f"demo: {whole / 1e6:.1f} MB pack, import {import_s:.2f} s, first request {warm_ttft:.3f} s "
          f"against {cold_ttft:.2f} s cold ({tokens - len(rest)} of {tokens} tokens reused)")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=C.positive_int, default=2048)
    ap.add_argument("--reps", type=C.positive_int, default=3)
    ap.add_argument("--weights-mb", type=C.positive_int, default=512, help="the Qwen3-0.6B-shaped model's weight file")
    args = ap.parse_args()
    root = C.scratch_dir("packs")
    try:
        data = {"machine": C.machine(), "command": f"python bench/packs.py --weights-mb {args.weights_mb}",
            "tokens": args.tokens,
                "sizes": sizes(root, args.tokens, args.weights_mb << 20), "import": import_speed(root, args.reps),
                "demo": demo(root, args.tokens)}
    finally:
        shutil.rmtree(root, ignore_errors=True)
    C.write_result("packs", data)
    print(report_sections.packs_table(data))


if __name__ == "__main__":
    main()
