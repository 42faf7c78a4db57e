"""8-bit packs (`disk_kv_bits=8`): every example prompt's canary holds when an honest pack is
imported, and a pack whose K/V were scaled (checksums, blob hashes and manifest rewritten, as
someone rewriting an unsigned pack would) is refused by it.

A prompt's canary is taken from its full-precision step; a replay from 8-bit K/V moves the
log-probabilities by up to 0.074 on these prompts, past the canary's tolerance. So an 8-bit
pack carries the canary of the step replayed from its own records (`packs.export`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from kvtest import rewrite_pack_tensors, run_cli

from kvstore import canary
from kvstore.storage import blobformat

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "prompts.jsonl"


def scale_kv(pack: Path, record: str, factor: float) -> None:
    """Multiply the K/V of one record of the pack by `factor` (its 8-bit scales and biases, so
    every dequantized value), with its checksums, blob SHA-256 and size made to match."""
    def scaled(name: str, info: dict, raw: bytes) -> bytes | None:
        if not name.endswith((".scales", ".biases")):
            return None
        assert info["dtype"] == "BF16"
        bits = np.frombuffer(raw, np.uint16)
        values = (bits.astype(np.uint32) << 16).view(np.float32) * np.float32(factor)
        return (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()

    rewrite_pack_tensors(pack, record, scaled)


def test_every_example_prompts_8bit_canary_holds_and_scaled_kv_is_refused(tmp_path, demo_model):
    model = demo_model("llama", "small", "bfloat16")
    bits = ["--disk-kv-bits", "8"]
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompts", EXAMPLES, "--unsigned",
            "--out", tmp_path / "pack", *bits)
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    assert len(doc["prompts"]) == len(doc["canaries"]) == 7
    # The pack's canaries are its own 8-bit replay's, and stay within the 8-bit bound of the
    # full-precision ones the exporter's store keeps.
    for h, fields in doc["canaries"].items():
        kept = blobformat.parse(next((tmp_path / "a").rglob(f"{h}.safetensors")).read_bytes())[2]
        full, packed = canary.parse(kept["x-canary"]), canary.parse(fields["canary"])
        assert (full.at, full.token) == (packed.at, packed.token)
        assert packed.ids[0] == full.ids[0] or full.margin < canary.QUANTIZED_TOLERANCE[8]
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model, *bits)
    assert "7 canaries by a replayed step" in result.stdout, result.stdout
    for prompt in range(7):  # each prompt's end record, its K/V x1.5: the canary refuses it
        bad = Path(shutil.copytree(tmp_path / "pack", tmp_path / f"bad-{prompt}"))
        last = doc["prompts"][prompt]["records"][-1]
        scale_kv(bad, last, 1.5)
        refused = run_cli("pack", "import", bad, "--store", tmp_path / "c", "--model", model, *bits, check=False)
        assert refused.returncode == 1, refused.stdout
        tokens = doc["prompts"][prompt]["tokens"]
        assert f"blobs/{last}.safetensors (tokens " in refused.stderr, refused.stderr
        assert f"of a prompt of {tokens} tokens): its canary does not hold for the replayed step" in refused.stderr
        assert not (tmp_path / "c").exists()
