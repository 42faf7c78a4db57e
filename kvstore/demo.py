"""Built-in demo models: tiny random-weight models of real mlx-lm architectures.

No model hub is reachable on the machines this project runs on, so tests and
the CLI demo need models that can be made locally.  ``build_demo_model`` writes
an ordinary model folder (``config.json``, ``model.safetensors``,
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``)
that ``mlx_lm.load(path)`` opens with no network access.

* The architectures are the real mlx-lm classes, chosen to cover the cache
  kinds a prompt-cache store must handle: ``llama`` (all ``KVCache``),
  ``gemma3_text`` (``RotatingKVCache`` sliding-window layers mixed with
  ``KVCache`` global layers, with a small window) and ``qwen3_5`` (linear
  attention ``ArraysCache`` layers mixed with ``KVCache`` layers) and
  ``baichuan_m1`` (every layer a ``CacheList`` of a short-convolution
  ``ArraysCache`` and a ``KVCache``, or a ``RotatingKVCache`` on its
  sliding-window layers).
* ``ensure_demo_model()`` is the one default every ``kvstore`` command uses
  without ``--model`` (warm, generate and serve alike), and what the README's
  Python examples load.
* Weights come from numpy's PCG64 generator seeded per tensor name, so the same
  arguments give byte-identical weight files on every machine (the model
  fingerprint is stable).  The text they produce is meaningless.
* The tokenizer is byte-level BPE with no merges: token id ``b`` is byte ``b``,
  so any UTF-8 text round-trips exactly, plus a few ChatML special tokens.
  One exception: for ``qwen3_5`` transformers >= 5 ignores tokenizer.json's
  pipeline and rebuilds its own Qwen3_5Tokenizer one, which NFC-normalizes on
  encode (as it does for real Qwen3.5 checkpoints); NFC text still round-trips.
* A folder is built in a temporary sibling and renamed into place, and its
  marker file ``kvstore-demo.json`` is written last, so concurrent builders
  never expose a half-written model and a finished one is reused.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
import tempfile
import zlib
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np

__all__ = ["ARCHS", "DEFAULT_DEMO", "DEMO_NOTE", "BUILDER_VERSION", "build_demo_model",
           "default_demo_path", "ensure_demo_model"]

# Bump whenever anything that changes the written files changes.
BUILDER_VERSION = 1
MARKER = "kvstore-demo.json"

ARCHS = ("llama", "gemma3_text", "qwen3_5", "baichuan_m1")
SIZES = ("tiny", "small")
DTYPES = ("float32", "bfloat16", "float16")

#: The demo model of every command run without --model (warm, generate, serve): one default,
#: so that what `kvstore warm` stores is what `kvstore serve` reuses.
DEFAULT_DEMO = {"arch": "llama", "size": "small"}

DEMO_NOTE = (
    "Note: this is a built-in demo model with random weights, so its text is "
    "meaningless; pass --model PATH_OR_HF_REPO (anything mlx_lm.load accepts) "
    "to use a real model."
)

# "<|endoftext|>" is there because transformers' Qwen3_5Tokenizer adds it as
# its default unk token; were it missing it would get id == vocab_size, past
# the end of the embedding table.
SPECIAL_TOKENS = ("<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|pad|>", "<|endoftext|>")
BOS_ID, EOS_ID, IM_START_ID, IM_END_ID, PAD_ID, ENDOFTEXT_ID = range(256, 256 + len(SPECIAL_TOKENS))
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)  # exact, so the model never emits an id the tokenizer lacks

# ChatML.  No whitespace-control dashes: they would eat the literal newlines.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Shared transformer dims per size (intermediate = MLP width).
_DIMS = {
    "tiny": dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, inter=128),
    "small": dict(hidden=256, layers=4, heads=8, kv_heads=2, head_dim=32, inter=512),
}
_MAX_POS = 32768
_SLIDING_WINDOW = {"tiny": 32, "small": 128}
_SLIDING_PATTERN = {"tiny": 2, "small": 4}  # every Nth layer is global
_CONV_WINDOW = 2  # baichuan_m1's short convolution over K and V (mlx-lm supports only 2)
# Linear-attention (gated delta net) dims: (key heads, value heads, head dim).
_LINEAR = {"tiny": (2, 4, 32), "small": (4, 8, 32)}
_LOGIT_STD = 3.0  # spread of logits: peaked enough for varied greedy output


def default_demo_path(
    arch: str = "llama", dtype: str = "float32", size: str = "tiny", *, seed: int = 0
) -> Path:
    """Cache folder for a demo model: ``~/.cache/kvstore-demo/<arch>-<size>-<dtype>-v<N>``.

    A non-default ``seed`` gets its own ``-s<seed>`` suffix so it never evicts
    the default model.
    """
    name = f"{arch}-{size}-{dtype}-v{BUILDER_VERSION}"
    if seed != 0:
        name += f"-s{seed}"
    return Path.home() / ".cache" / "kvstore-demo" / name


def ensure_demo_model() -> Path:
    """The folder of the default demo model (`DEFAULT_DEMO`), built on first use in about a
    second and reused after: what every `kvstore` command uses without `--model`.

        from mlx_lm import load
        model, tokenizer = load(str(ensure_demo_model()))
    """
    return build_demo_model(**DEFAULT_DEMO)


def build_demo_model(
    path: Optional[os.PathLike | str] = None,
    arch: str = "llama",
    *,
    dtype: str = "float32",
    seed: int = 0,
    size: str = "tiny",
    overwrite: bool = False,
) -> Path:
    """Build (or reuse) a random-weight demo model folder and return its path.

    An existing folder is reused when its marker records the same builder
    version and parameters.  A folder with an outdated marker is replaced; a
    folder without a marker is only replaced with ``overwrite=True`` (it may
    be someone's real data).
    """
    if arch not in ARCHS:
        raise ValueError(f"unknown demo arch {arch!r}; choose from {ARCHS}")
    if size not in SIZES:
        raise ValueError(f"unknown demo size {size!r}; choose from {SIZES}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown demo dtype {dtype!r}; choose from {DTYPES}")
    seed = int(seed)
    path = Path(path) if path is not None else default_demo_path(arch, dtype, size, seed=seed)
    path = path.expanduser().absolute()
    params = {"builder_version": BUILDER_VERSION, "arch": arch, "size": size,
              "dtype": dtype, "seed": seed}

    if not overwrite and _is_complete(path, params):
        return path
    if path.exists() and not overwrite and not (path / MARKER).exists() and any(path.iterdir()):
        raise FileExistsError(f"{path} exists and is not a kvstore demo model; pass overwrite=True")

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        _write_model(tmp, params)
        _install(tmp, path, params, overwrite)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def _is_complete(path: Path, params: Dict[str, Any]) -> bool:
    """True if ``path`` holds a finished build with exactly these parameters."""
    try:
        marker = json.loads((path / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("params") != params:
        return False
    files = marker.get("files", {})
    return bool(files) and all(
        (path / name).is_file() and (path / name).stat().st_size == info["size"]
        for name, info in files.items()
    )


def _install(tmp: Path, path: Path, params: Dict[str, Any], overwrite: bool) -> None:
    """Move the finished ``tmp`` folder to ``path`` atomically.

    rename() of a directory onto a non-empty directory fails, so an old folder
    is first renamed aside.  When another process installs a matching model
    first, ours is simply dropped.
    """
    error: Optional[OSError] = None
    for _ in range(5):
        try:
            os.rename(tmp, path)
            return
        except OSError as e:
            error = e
            if not path.exists():
                continue  # someone moved it aside between our calls; retry
        if _is_complete(path, params) and not overwrite:
            return  # a concurrent builder won the race with an identical model
        overwrite = False  # replace at most once, then accept a concurrent winner
        trash = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
        try:
            os.rename(path, trash / "old")
        except FileNotFoundError:
            pass
        finally:
            shutil.rmtree(trash, ignore_errors=True)
    raise RuntimeError(f"could not install demo model at {path}") from error


def _write_model(folder: Path, params: Dict[str, Any]) -> None:
    config = _config(params["arch"], params["size"], params["dtype"])
    _write_json(folder / "config.json", config)
    _write_weights(folder / "model.safetensors", config, params)
    _write_tokenizer(folder)
    files = {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(folder.iterdir())
    }
    # The marker goes last, via rename, so its presence means "complete".
    _write_json(folder / MARKER, {"params": params, "files": files})


def _write_json(target: Path, obj: Any) -> None:
    tmp = target.with_name(target.name + ".part")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                   encoding="utf-8")
    os.replace(tmp, target)


def _config(arch: str, size: str, dtype: str) -> Dict[str, Any]:
    d = _DIMS[size]
    common = {
        "hidden_size": d["hidden"],
        "num_hidden_layers": d["layers"],
        "intermediate_size": d["inter"],
        "num_attention_heads": d["heads"],
        "num_key_value_heads": d["kv_heads"],
        "head_dim": d["head_dim"],
        "vocab_size": VOCAB_SIZE,
        "max_position_embeddings": _MAX_POS,
        # Untied so the output scale is set independently of the embedding.
        "tie_word_embeddings": False,
    }
    tokens = {"bos_token_id": BOS_ID, "eos_token_id": [EOS_ID, IM_END_ID],
              "pad_token_id": PAD_ID, "torch_dtype": dtype}
    if arch == "llama":
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **common,
                "rms_norm_eps": 1e-5, "rope_theta": 10000.0, **tokens}
    if arch == "gemma3_text":
        pattern, n = _SLIDING_PATTERN[size], d["layers"]
        return {
            "model_type": "gemma3_text", "architectures": ["Gemma3ForCausalLM"], **common,
            "rms_norm_eps": 1e-6, "rope_theta": 1_000_000.0, "rope_local_base_freq": 10000.0,
            "query_pre_attn_scalar": d["head_dim"], "sliding_window": _SLIDING_WINDOW[size],
            # mlx-lm reads sliding_window_pattern; layer_types is the HF spelling.
            "sliding_window_pattern": pattern,
            "layer_types": ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                            for i in range(n)],
            **tokens,
        }
    if arch == "baichuan_m1":
        pattern, n = _SLIDING_PATTERN[size], d["layers"]
        # mlx-lm derives head_dim from hidden_size / heads, as the real checkpoints do.
        assert d["hidden"] // d["heads"] == d["head_dim"]
        return {"model_type": "baichuan_m1", "architectures": ["BaichuanM1ForCausalLM"], **common,
                "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "conv_window": _CONV_WINDOW,
                "sliding_window": _SLIDING_WINDOW[size],
                "sliding_window_layers": [i for i in range(n) if (i + 1) % pattern != 0],
                **tokens}
    # qwen3_5 is a vision-language wrapper: the text model lives in text_config,
    # as in the real checkpoints.  Every 4th layer is full attention.
    kh, vh, lhd = _LINEAR[size]
    text = {
        "model_type": "qwen3_5_text", **common, "rms_norm_eps": 1e-6,
        "linear_num_key_heads": kh, "linear_num_value_heads": vh,
        "linear_key_head_dim": lhd, "linear_value_head_dim": lhd,
        "linear_conv_kernel_dim": 4, "full_attention_interval": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0,
                            "partial_rotary_factor": 0.25},
        **tokens,
    }
    return {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
            "text_config": text, "tie_word_embeddings": False, **tokens}


def _write_weights(target: Path, config: Dict[str, Any], params: Dict[str, Any]) -> None:
    import mlx.core as mx
    from mlx.utils import tree_flatten

    module = importlib.import_module(f"mlx_lm.models.{config['model_type']}")
    # The real mlx-lm class gives the exact parameter names and shapes that
    # mlx_lm.load expects; its own random init is discarded.
    model = module.Model(module.ModelArgs.from_dict(config))
    hidden = _DIMS[params["size"]]["hidden"]
    arch, seed = params["arch"], params["seed"]
    # As mlx-lm's converter does: some tensors (qwen3_5's A_log) stay float32.
    should_cast = getattr(model, "cast_predicate", None) or (lambda _k: True)
    dtype = getattr(mx, params["dtype"])

    weights = {}
    for key, default in sorted(tree_flatten(model.parameters())):
        # One generator per tensor name: values don't depend on tensor order.
        rng = np.random.default_rng([seed, zlib.crc32(key.encode())])
        shape = tuple(default.shape)
        if key.endswith("A_log"):  # linear-attention decay rates, as mlx-lm inits them
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif key.endswith(("conv_k", "conv_v")):  # baichuan_m1: mix of previous and current K/V
            w = rng.uniform(0.5, 1.0, shape)
        elif len(shape) == 1:
            if key.endswith(".bias") or (arch == "gemma3_text" and "norm" in key):
                w = np.zeros(shape)  # biases; Gemma norms scale by (1 + w)
            else:
                w = np.ones(shape)  # RMSNorm scales at identity; dt_bias as mlx-lm inits it
        elif key.endswith("embed_tokens.weight"):
            # Gemma multiplies embeddings by sqrt(hidden); keep unit scale after it.
            std = hidden**-0.5 if arch == "gemma3_text" else 1.0
            w = rng.standard_normal(shape) * std
        elif key.endswith("lm_head.weight"):
            w = rng.standard_normal(shape) * (_LOGIT_STD / hidden**0.5)
            # Damp rows other than printable ASCII so sampled text is mostly
            # readable characters rather than broken UTF-8 and control bytes.
            readable = np.zeros(shape[0], bool)
            readable[[0x0A, *range(0x20, 0x7F)]] = True
            w[~readable] *= 0.3
        else:  # linear / conv: unit-variance activations
            w = rng.standard_normal(shape) / np.sqrt(np.prod(shape[1:]))
        arr = mx.array(w.astype(np.float32))
        weights[key] = arr.astype(dtype) if should_cast(key) else arr
    # Check names and shapes now rather than at mlx_lm.load time.
    model.load_weights(list(weights.items()), strict=True)
    mx.save_safetensors(str(target), weights, metadata={"format": "mlx"})


def _bytes_to_unicode() -> Dict[int, str]:
    """GPT-2's reversible byte -> printable-unicode-character mapping."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _write_tokenizer(folder: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    byte_chars = _bytes_to_unicode()
    vocab = {byte_chars[b]: b for b in range(256)}  # token id == byte value
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE and tok.token_to_id("<|pad|>") == PAD_ID
    (folder / "tokenizer.json").write_text(tok.to_str(pretty=True), encoding="utf-8")

    specials = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>",
                "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}
    _write_json(folder / "special_tokens_map.json", specials)
    _write_json(folder / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **specials,
        "add_bos_token": False,
        "add_eos_token": False,
        # Otherwise decode() would rewrite " ." to "." and break round-trips.
        "clean_up_tokenization_spaces": False,
        "model_max_length": _MAX_POS,
        "chat_template": CHAT_TEMPLATE,
    })
