"""Tests for kvstore.demo: offline random-weight demo models that mlx_lm.load opens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import unicodedata
from pathlib import Path

import mlx.core as mx
import mlx_lm
import pytest
from mlx_lm.models.cache import ArraysCache, CacheList, KVCache, RotatingKVCache, make_prompt_cache

try:
    from kvstore import demo
except ImportError:  # run without the package installed / on sys.path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvstore import demo

from kvstore.demo import ARCHS, DEMO_NOTE, build_demo_model, default_demo_path

REPO = Path(__file__).resolve().parents[1]
# NFC text: non-ASCII, emoji, control bytes, runs of spaces, a special token.
TEXT = "Grüße, naïve café — 日本語 🙂\ttabs  and\r\nnewlines <|im_end|> \x00 end ."
DECOMPOSED = "cafe\u0301 \ufb01 \u212b"  # changed by NFC normalization


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open a network connection fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def _layer_kinds(model) -> list:
    return [type(c) for c in make_prompt_cache(model)]


@pytest.mark.parametrize("arch", ARCHS)
def test_build_load_forward(tmp_path, arch):
    path = build_demo_model(tmp_path / arch, arch)
    assert path == (tmp_path / arch).absolute()
    for name in ("config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "kvstore-demo.json"):
        assert (path / name).is_file(), name

    model, tok = mlx_lm.load(str(path))
    caches = make_prompt_cache(model)
    kinds = set(type(c) for c in caches)
    if arch == "llama":
        assert kinds == {KVCache}
    elif arch == "gemma3_text":
        assert kinds == {RotatingKVCache, KVCache}
        windows = {c.max_size for c in caches if isinstance(c, RotatingKVCache)}
        assert max(windows) < 100  # prompts longer than the window stay cheap in tests
    elif arch == "qwen3_5":
        assert kinds == {ArraysCache, KVCache}
    elif arch == "baichuan_m1":  # a real mlx-lm architecture whose layers are CacheLists
        assert kinds == {CacheList}
        assert {tuple(type(c) for c in layer.caches) for layer in caches} == {
            (ArraysCache, RotatingKVCache), (ArraysCache, KVCache)}

    ids = tok.encode("The quick brown fox jumps.")[:20]
    assert len(ids) == 20
    logits = model(mx.array([ids]))
    vocab = demo.VOCAB_SIZE
    assert logits.shape == (1, 20, vocab)
    assert mx.all(mx.isfinite(logits)).item()
    # Different positions give different next-token preferences (not a dead model).
    assert len(set(mx.argmax(logits[0], axis=-1).tolist())) > 1

    # Cached decoding agrees with a full forward pass, also for a prompt longer
    # than gemma3_text's sliding window.
    long_ids = tok.encode("a fairly long prompt, " * 4)
    assert len(long_ids) > 80
    full = model(mx.array([long_ids]))
    cache = make_prompt_cache(model)
    model(mx.array([long_ids[:-1]]), cache=cache)
    last = model(mx.array([long_ids[-1:]]), cache=cache)
    assert mx.allclose(last[0, -1], full[0, -1], atol=1e-3).item()


@pytest.mark.parametrize("arch", ARCHS)
def test_tokenizer(tmp_path, arch):
    _, tok = mlx_lm.load(str(build_demo_model(tmp_path / "m", arch)))
    assert tok.encode("hello") == list(b"hello")  # byte-level, no BOS added
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT
    # No token id the embedding table lacks, whichever transformers class loads it.
    assert len(tok._tokenizer) == demo.VOCAB_SIZE
    assert max(tok.encode("<|endoftext|><|pad|><|bos|>")) < demo.VOCAB_SIZE
    back = tok.decode(tok.encode(DECOMPOSED))
    if arch == "qwen3_5":  # transformers >= 5 forces Qwen3_5Tokenizer, which applies NFC
        assert back in (DECOMPOSED, unicodedata.normalize("NFC", DECOMPOSED))
    else:
        assert back == DECOMPOSED
    assert tok.eos_token_id == demo.EOS_ID
    assert demo.IM_END_ID in tok.eos_token_ids

    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                     add_generation_prompt=True)
    assert isinstance(prompt, list) and all(isinstance(i, int) for i in prompt)
    assert tok.decode(prompt) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert prompt[0] == demo.IM_START_ID
    bare = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                   add_generation_prompt=False)
    assert prompt[: len(bare)] == bare and len(bare) < len(prompt)


def test_deterministic_and_reused(tmp_path):
    a = build_demo_model(tmp_path / "a", "qwen3_5")
    b = build_demo_model(tmp_path / "b", "qwen3_5")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "kvstore-demo.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    before = (a / "model.safetensors").stat()
    assert build_demo_model(tmp_path / "a", "qwen3_5") == a
    after = (a / "model.safetensors").stat()
    assert (before.st_ino, before.st_mtime_ns) == (after.st_ino, after.st_mtime_ns)

    c = build_demo_model(tmp_path / "c", "qwen3_5", seed=1)
    assert (c / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()
    # Other parameters at the same path replace the old build.
    build_demo_model(tmp_path / "a", "qwen3_5", seed=1)
    assert (a / "model.safetensors").read_bytes() == (c / "model.safetensors").read_bytes()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp leftovers


def test_overwrite_rules(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("not a model")
    with pytest.raises(FileExistsError):
        build_demo_model(foreign)
    build_demo_model(foreign, overwrite=True)
    assert not (foreign / "notes.txt").exists()

    # A damaged build (file truncated) is detected and rebuilt.
    weights = foreign / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:100])
    build_demo_model(foreign)
    assert weights.read_bytes() == good


@pytest.mark.parametrize("arch,dtype", [("llama", "bfloat16"), ("gemma3_text", "float16"),
                                        ("qwen3_5", "bfloat16")])
def test_dtypes(tmp_path, arch, dtype):
    path = build_demo_model(tmp_path / "m", arch, dtype=dtype)
    config = json.loads((path / "config.json").read_text())
    assert config["torch_dtype"] == dtype
    model, tok = mlx_lm.load(str(path))
    weights = mx.load(str(path / "model.safetensors"))
    assert {v.dtype for k, v in weights.items() if not k.endswith("A_log")} == {getattr(mx, dtype)}
    logits = model(mx.array([tok.encode("hello world, again")]))
    assert mx.all(mx.isfinite(logits)).item()


@pytest.mark.parametrize("offline", ["1", None])
def test_hub_offline_env(tmp_path, monkeypatch, offline):
    if offline is None:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    else:
        monkeypatch.setenv("HF_HUB_OFFLINE", offline)
    model, tok = mlx_lm.load(str(build_demo_model(tmp_path / "m", "llama")))
    assert tok.decode(tok.encode(TEXT)) == TEXT


def test_default_path_and_note(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    expected = tmp_path / ".cache" / "kvstore-demo" / f"gemma3_text-small-bfloat16-v{demo.BUILDER_VERSION}"
    assert default_demo_path("gemma3_text", "bfloat16", "small") == expected
    assert build_demo_model() == default_demo_path()
    assert (default_demo_path() / "kvstore-demo.json").is_file()
    assert "--model" in DEMO_NOTE and "\n" not in DEMO_NOTE
    with pytest.raises(ValueError):
        build_demo_model(tmp_path / "x", "gpt2")


def test_concurrent_builders(tmp_path):
    """Two processes building the same folder both end with the same complete model."""
    target = tmp_path / "shared"
    code = ("import sys; from kvstore.demo import build_demo_model; "
            "print(build_demo_model(sys.argv[1], 'gemma3_text'))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(target)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        assert Path(out.strip()) == target
    ref = build_demo_model(tmp_path / "ref", "gemma3_text")
    assert (target / "model.safetensors").read_bytes() == (ref / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ref", "shared"]
