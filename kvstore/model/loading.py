"""Loading a model for `kvstore warm` and `kvstore generate`, and checking prompt lines against it.

`resolve_model` says what `--model` names (a folder, a repo id, or the demo model), `load_model`
loads it with mlx-lm (with its vocabulary size and context length), and `prepare` tokenizes the
parsed prompt lines and keeps those that fit the model. mlx-lm is imported only by `load_model`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.errors import ModelFilesError
from kvstore.model import jsonl

DEFAULT_CONTEXT = 1 << 20  # when a model's config names no context length
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "max_sequence_length",
                "seq_length", "n_ctx")


@dataclass
class LoadedModel:
    """A model loaded with mlx-lm, and what its prompts are checked against."""

    model: Any
    tokenizer: Any
    model_id: str  # what the store records: an absolute folder or a repo id
    vocab_size: int | None
    context: int


def resolve_model(spec: str | None) -> str:
    """What to load for `spec`: a local folder (checked now), a repo id, or (None) the demo model,
    the same default as `kvstore serve`. Raises ModelFilesError for a path that is no model."""
    if spec is None:
        from kvstore.demo import ensure_demo_model

        return str(ensure_demo_model())
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ModelFilesError(f"model path {spec} is a file, not a model folder (pass the folder that "
                                  "holds its config.json and weights, or a Hugging Face repo id)")
        config = path / "config.json"
        if not config.is_file():
            raise ModelFilesError(f"model folder {spec} has no config.json: is it an mlx-lm model?")
        try:
            json.loads(config.read_bytes())
        except OSError as e:
            raise ModelFilesError(f"cannot read {config}: {e.strerror or e}") from None
        except ValueError as e:  # mlx-lm's own error would not name the file
            raise ModelFilesError(f"{config} is not valid JSON ({e}): is it an mlx-lm model?") from None
        return str(path.resolve())
    if _looks_like_path(spec):
        raise ModelFilesError(f"model path {spec} does not exist (pass a model folder or a Hugging Face repo id)")
    return spec


def _looks_like_path(spec: str) -> bool:
    """A Hugging Face repo id is `owner/name`; anything else that is not on disk is a bad path."""
    return spec.startswith((".", "/", "~")) or "\\" in spec or spec.count("/") != 1 or spec.endswith("/")


def load_model(model_id: str) -> LoadedModel:
    """Load a model with mlx-lm, with its vocabulary size and context length. Raises
    ModelFilesError, in one line, whatever mlx-lm raised."""
    import mlx_lm

    try:
        model, tokenizer, config = mlx_lm.load(model_id, return_config=True)
    except Exception as e:  # mlx-lm raises many kinds; all mean "this model cannot be used"
        detail = " ".join(str(e).split())  # one line, whatever the library wrote
        raise ModelFilesError(f"cannot load model {model_id}: {detail}") from e
    configs = [config, config.get("text_config") or {}]
    vocab = next((c["vocab_size"] for c in configs if isinstance(c.get("vocab_size"), int)), None)
    if vocab is None:
        try:
            vocab = len(tokenizer.get_vocab())
        except Exception:
            vocab = None
    return LoadedModel(model, tokenizer, model_id, vocab, context_of(config) or DEFAULT_CONTEXT)


def context_of(config: dict) -> int | None:
    """The context in tokens a model's config states (or its text config's): its length times its
    RoPE scaling factor (YaRN, linear...: a scaled model serves that much more); None if it names none."""
    for c in (config, config.get("text_config") or {}):
        n = next((c[k] for k in CONTEXT_KEYS if isinstance(c.get(k), int) and c[k] > 0), None)
        if n is not None:
            scaling = c.get("rope_scaling") or {}
            factor = scaling.get("factor") if isinstance(scaling, dict) else None
            return int(n * factor) if isinstance(factor, (int, float)) and factor > 1 else n
    return None


def prepare(items: list, loaded: LoadedModel) -> tuple[list, list]:
    """Tokenize parsed prompt lines and check them against the model: (good, errors), where good
    holds (`jsonl.PromptLine`, tokens) pairs and errors `jsonl.LineError`s."""
    good, errors = [], []
    for item in items:
        if isinstance(item, jsonl.LineError):
            errors.append(item)
            continue
        result = _tokens_of(item, loaded)
        (errors if isinstance(result, jsonl.LineError) else good).append(result)
    return good, errors


def _tokens_of(item: jsonl.PromptLine, loaded: LoadedModel):
    """(item, tokens) for a line that fits the model, else its `jsonl.LineError`."""
    too_long = jsonl.check_length(item, loaded.context)  # before tokenizing: cheap, bounded
    if too_long is not None:
        return jsonl.LineError(item.source, item.line, *too_long)
    try:
        tokens = jsonl.tokenize(item, loaded.tokenizer)
    except Exception as e:  # a chat template can raise anything (jinja errors, KeyError, ...)
        return jsonl.LineError(item.source, item.line, item.kind, f"cannot be tokenized: {e}")
    problem = None
    if len(tokens) == 0:
        problem = (item.kind, "gives no tokens")
    elif loaded.vocab_size is not None:
        problem = jsonl.check_vocab(tokens, loaded.vocab_size)
    if problem is None and len(tokens) > loaded.context:
        problem = (item.kind, f"skipped: {len(tokens)} tokens is longer than the model's context "
                              f"({loaded.context} tokens)")
    if problem is not None:
        return jsonl.LineError(item.source, item.line, *problem)
    return item, tokens
