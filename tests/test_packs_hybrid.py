"""A pack of a model with recurrent layers (qwen3_5: restored only at a checkpoint) carries the
checkpoints within its prompts that the exporting store holds (`warm` keeps one every 4 chunks),
so the importing store restores what the exporting one does: a request of the same prompt, or one
that leaves it before its end (a chat turn after a system prompt rendered with its generation
prompt), reused nothing after an import (the pack held only the checkpoint at the prompt's end,
where no request that differs before it can resume)."""

from __future__ import annotations

import json

from kvtest import run_cli, run_procs
from test_packs import tokens_of

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
    # Not replayed from the checkpoint at 1,024: the tail after it would be computed again, not checked.
    assert "1 canary not replayable" in result.stdout, result.stdout
    assert "7 records stored on disk" in result.stdout
    got = run_procs("check", tmp_path / "b", model, 256, tokens)  # the same prompt again
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
