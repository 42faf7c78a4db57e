"""A pack of a model with recurrent layers (qwen3_5: restored only at a checkpoint) carries the
checkpoints within its prompts that the exporting store holds (`warm` keeps one every 4 chunks),
and each prompt's records at its last token but one (its `resume` records), so the importing store
restores what the exporting one does: a request that leaves the prompt before its end (a chat turn
after a system prompt rendered with its generation prompt) reused nothing after an import when the
pack held only the checkpoint at the prompt's end, and the same prompt again reused nothing (or
only up to the last checkpoint within it) when it held no resume records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
from kvtest import rewrite_pack_tensors, run_cli, run_procs
from test_packs import tokens_of

from kvstore.packs import manifest as packfile

PROMPT = "You are the assistant of a small team. Answer briefly. " + "Notes on the build: " * 60  # 1,256 tokens


def test_a_hybrid_pack_carries_the_checkpoints_within_its_prompt(tmp_path, demo_model):
    model = demo_model("qwen3_5")
    tokens = tokens_of(model, PROMPT)
    assert 1024 < len(tokens) < 1280
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT, "--unsigned",
            "--out", tmp_path / "pack")
    chain = json.loads((tmp_path / "pack" / "manifest.json").read_text())["prompts"][0]["records"]
    assert len(chain) == 4 + 1 + 1 + 1  # 4 chunks, the checkpoint at the 4th, the tail, the end's
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    # Replayed from the checkpoint at the last token but one (a resume record), not from the one at
    # 1,024 (the tail after it would be computed again, not checked).
    assert "1 canary by a replayed step" in result.stdout, result.stdout
    assert "9 records stored on disk" in result.stdout  # and the tail and checkpoint at the last token but one
    got = run_procs("check", tmp_path / "b", model, 256, tokens + tokens_of(model, " Next?"))
    assert got["reused"] == len(tokens) and got["max_abs_diff"] < 1e-3
    # Without the resume records, a request that leaves it before its end resumes from 1,024.
    got = run_procs("check", tmp_path / "b", model, 256, tokens[:-2] + tokens_of(model, " Next?"))
    assert got["reused"] == 1024 and got["max_abs_diff"] < 1e-3


def test_a_checkpoint_out_of_its_place_in_the_chain_is_refused(tmp_path, demo_model):
    model = demo_model("qwen3_5")
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", PROMPT, "--unsigned",
            "--out", tmp_path / "pack")
    path = tmp_path / "pack" / "manifest.json"
    doc = json.loads(path.read_text())
    chain = doc["prompts"][0]["records"]
    chain.insert(2, chain.pop(4))  # the checkpoint of chunk 4 listed after chunk 2
    path.write_text(json.dumps(doc))
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model, check=False)
    assert result.returncode == 1 and "the chain recomputed from its tokens differs from manifest.json's " \
        "prompts[0].records at record 3 of 7" in result.stderr, result.stderr
    assert not (tmp_path / "b").exists()


def test_a_hybrid_prompt_within_a_longer_one_keeps_its_own_end(tmp_path, demo_model):
    """A prompt that is the start of another of the export: a model with recurrent layers
    restores it whole only from the checkpoint at its own end, which the llama-style folding into
    the longer prompt left out (a continuation of it reused 1,024 tokens after an import, all of
    it in the exporting store), so the pack carries it as a prompt of its own. A prompt given
    twice is said as a repeat."""
    model = demo_model("qwen3_5")
    longer = PROMPT + " And a follow-up that runs on for a while. " * 2
    lines = tmp_path / "p.jsonl"
    lines.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in (PROMPT, longer, longer)))
    result = run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompts", lines, "--unsigned",
                     "--out", tmp_path / "pack")
    assert "2 prompts (1 repeat of them, carried once)" in result.stdout, result.stdout
    doc = json.loads((tmp_path / "pack" / "manifest.json").read_text())
    short = tokens_of(model, PROMPT)
    assert [p["tokens"] for p in doc["prompts"]] == [len(short), len(tokens_of(model, longer))]
    run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    got = run_procs("check", tmp_path / "b", model, 256, short + tokens_of(model, " Next?"))
    assert got["reused"] == len(short) and got["max_abs_diff"] < 1e-3


SHORT = "You are the assistant of a small team. Answer briefly. " + "Notes on the build: " * 5  # < 1 chunk


def _key_pair(root: Path) -> tuple[Path, Path]:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    private, public = root / "key.pem", root / "key.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def test_the_same_prompt_again_resumes_after_an_import_as_in_the_exporting_store(tmp_path, demo_model):
    """The pack carries the tail and checkpoint `prefill` stores at the prompt's last token but one:
    the same prompt again, in a fresh process on the importing store, reuses what it reuses on the
    exporting store (all but its last token; it reused none after an import without them), with
    the greedy tokens of a run from scratch."""
    model = demo_model("qwen3_5")
    tokens = tokens_of(model, SHORT)
    assert 2 < len(tokens) < 256
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", SHORT, "--unsigned",
            "--out", tmp_path / "pack")
    prompt = json.loads((tmp_path / "pack" / "manifest.json").read_text())["prompts"][0]
    assert len(prompt["records"]) == 2 and len(prompt["resume"]) == 2  # tail, checkpoint; the same one token short
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    assert "1 canary by a replayed step" in result.stdout and "4 records pinned" in result.stdout, result.stdout
    here = run_procs("check", tmp_path / "a", model, 256, tokens, greedy=8)
    there = run_procs("check", tmp_path / "b", model, 256, tokens, greedy=8)
    assert here["reused"] == there["reused"] == len(tokens) - 1
    assert there["greedy"] == there["greedy_ref"] == here["greedy"] and there["max_abs_diff"] < 1e-3


def test_a_pack_without_resume_records_still_imports(tmp_path, demo_model):
    """A pack whose manifest lists no `resume` (as every pack made before they were carried)
    imports as it did: its canary is not replayable, and the same prompt again is computed."""
    model = demo_model("qwen3_5")
    tokens = tokens_of(model, SHORT)
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", SHORT, "--unsigned",
            "--out", tmp_path / "pack")
    path = tmp_path / "pack" / "manifest.json"
    doc = json.loads(path.read_text())
    for h in doc["prompts"][0].pop("resume"):
        del doc["records"][h]
        (tmp_path / "pack" / packfile.blob_name(h)).unlink()
    path.write_text(json.dumps(doc))
    result = run_cli("pack", "import", tmp_path / "pack", "--store", tmp_path / "b", "--model", model)
    assert "1 canary not replayable" in result.stdout and "2 records stored on disk" in result.stdout
    assert run_procs("check", tmp_path / "b", model, 256, tokens)["reused"] == 0
    got = run_procs("check", tmp_path / "b", model, 256, tokens + tokens_of(model, " Next?"))
    assert got["reused"] == len(tokens) and got["max_abs_diff"] < 1e-3


def _scale(pack: Path, record: str, factor: float) -> None:
    """Multiply every float32 tensor of one record of the pack by `factor`, with its checksums,
    blob SHA-256 and size in the manifest made to match (as someone rewriting a pack would)."""
    rewrite_pack_tensors(pack, record, lambda name, info, raw: None if info["dtype"] != "F32" else
                         (np.frombuffer(raw, np.float32) * np.float32(factor)).tobytes())


def test_a_changed_resume_record_is_refused(tmp_path, demo_model):
    """The resume records are blobs of the pack like any other: signed, hashed, checked against
    the records the prompt's tokens give, and (their checkpoint is where the canary's step
    restores) checked by the canary. Each change is refused and nothing is stored."""
    model = demo_model("qwen3_5")
    private, public = _key_pair(tmp_path)
    run_cli("pack", "export", "--store", tmp_path / "a", "--model", model, "--prompt", SHORT, "--sign-key", private,
            "--out", tmp_path / "pack")
    tail, point = json.loads((tmp_path / "pack" / "manifest.json").read_text())["prompts"][0]["resume"]

    def refused(change, want: str, *trust) -> None:
        pack = tmp_path / f"pack-{change.__name__}-{len(trust)}"
        shutil.copytree(tmp_path / "pack", pack)
        change(pack)
        got = run_cli("pack", "import", pack, "--store", tmp_path / "b", "--model", model, *trust, check=False)
        assert got.returncode == 1 and want in got.stderr, got.stderr
        assert not (tmp_path / "b").exists()

    def flipped(pack: Path) -> None:
        blob = pack / packfile.blob_name(point)
        data = bytearray(blob.read_bytes())
        data[-3] ^= 0x10  # in the recurrent state
        blob.write_bytes(bytes(data))

    def scaled(pack: Path) -> None:
        _scale(pack, point, 1.5)

    def listed_short(pack: Path) -> None:
        doc = json.loads((pack / "manifest.json").read_text())
        doc["prompts"][0]["resume"] = [tail]
        del doc["records"][point]
        (pack / packfile.blob_name(point)).unlink()
        (pack / "manifest.json").write_text(json.dumps(doc))
        (pack / "model.sig").unlink()

    refused(flipped, f"blob {packfile.blob_name(point)} does not match its SHA-256 in the manifest",
            "--trust-key", public)
    refused(scaled, "manifest.json was changed after the pack was signed", "--trust-key", public)
    refused(scaled, "its canary does not hold for the replayed step")
    refused(listed_short, "prompts[0].resume is not the records its tokens give at its last token but one")
