"""What `kvstore serve` gives routers and agent harnesses besides KV events.

- vLLM's render endpoints, `POST /v1/chat/completions/render` and `/v1/completions/render`: the
  token ids mlx_lm.server would prefill for a request, made by the very function its generation
  path calls (`ResponseGenerator._tokenize`), with nothing generated. A router such as llm-d's
  precise scorer hashes them to find the node that holds them.
- `POST /kvstore/prefetch` with `messages`, `prompt` or `tokens`: that prompt's stored cache
  restored into the memory tier ahead of its request (`PersistentPromptCache.prefetch`).
- `--warm-top N` (`warm_top`): the N most-hit prompts of the store loaded into the memory tier
  before the server listens, so before `/health` says ready.

A prompt's "most hit" is read from the index: every fetch counts a hit on each record it
restored from, so hits only fall along a chain. A record is where prompts end or part (a system
prompt, a conversation) when it has more hits than any of its children; those are ranked by hits
(deeper first on a tie), each with the chain that leads to it; one within a chain already
chosen (the first chunk of a system prompt, restored by other prompts too) is not a prompt of its
own.
"""

from __future__ import annotations

import json
import logging
import types
import uuid
from typing import Any

import numpy as np

from kvstore.argv import did_you_mean
from kvstore.errors import BlobError
from kvstore.model.jsonl import MAX_CHARS_PER_TOKEN, check_tokens
from kvstore.model.loading import context_of
from kvstore.records import CHECKPOINT
from kvstore.serve.binding import Binding
from kvstore.serve.promptcache import PersistentPromptCache
from kvstore.sizes import format_size, plural
from kvstore.storage.blobfile import open_blob
from kvstore.storage.index import Index, Row

log = logging.getLogger("kvstore")

RENDER_PATHS = ("/v1/chat/completions/render", "/v1/completions/render")
PREFETCH_PATH = "/kvstore/prefetch"
#: What a request's chat template may add to its texts' tokens (`check_fits`): in all, and a message.
TEMPLATE_TOKENS, MESSAGE_TOKENS = 1024, 32


class RequestError(Exception):
    """A request this module cannot serve: its HTTP status and message."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


# -- render ------------------------------------------------------------------------------------

def render(generator: Any, path: str, body: dict, served_model: str | None) -> Any:
    """The answer to a render request: for chat, `{request_id, model, token_ids, features,
    sampling_params}`; for completions, a list of those, one per prompt (as vLLM answers)."""
    tokenizer = _tokenizer(generator, body, served_model)
    args = types.SimpleNamespace(chat_template_kwargs=body.get("chat_template_kwargs"))
    model = body.get("model") or served_model
    params = _sampling(generator, body)
    if path == "/v1/chat/completions/render":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "the request has no messages (a list of {role, content})")
        request = _completion_request("chat", "", messages, body.get("tools") or None, body.get("role_mapping"))
        ids = _prompt_of(generator, tokenizer, request, args)
        return {"request_id": f"chatcmpl-{uuid.uuid4().hex}", "model": model, "token_ids": ids,
                "features": None, "sampling_params": params}
    prompts = body.get("prompt")
    prompts = [prompts] if isinstance(prompts, str) else prompts
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) and p for p in prompts):
        raise RequestError(400, "prompt must be a non-empty string or a list of them")
    rid = uuid.uuid4().hex
    return [{"request_id": f"cmpl-{rid}-{i}", "model": model, "features": None, "sampling_params": params,
             "token_ids": _prompt_of(generator, tokenizer, _completion_request("text", p, [], None, None), args)}
            for i, p in enumerate(prompts)]


def check_fits(generator: Any, path: str, body: dict, served_model: str | None) -> None:
    """RequestError (400) for a generation request that cannot fit the served model's context:
    a text longer than any tokenizer fits (before it is tokenized: that costs time and memory per
    character), a prompt of more tokens (tokenized as the generation path does, when its bytes do
    not show it fits), or a max_tokens beyond it. A model whose config names no context is not checked."""
    bias, vocab = body.get("logit_bias"), _vocab_size(generator)
    for key in bias if isinstance(bias, dict) and vocab else ():  # (an id past the vocabulary kills mlx)
        if not str(key).strip().isdigit() or int(key) >= vocab:
            raise RequestError(400, f"logit_bias: {str(key)[:20]!r} is not a token id of the model (0 to {vocab - 1})")
    context = _context(generator)
    if context is None or body.get("model") not in (None, served_model, "default_model"):
        return  # (another model is loaded for it: mlx_lm.server checks that one itself)
    texts = _texts(body)
    chars = sum(len(t) for t in texts)
    if chars > context * MAX_CHARS_PER_TOKEN:
        raise RequestError(400, f"the prompt is {chars:,} characters: more than any tokenizer fits in the "
                                f"model's context ({context:,} tokens)")
    wanted = body.get("max_completion_tokens") or body.get("max_tokens")
    if isinstance(wanted, int) and not isinstance(wanted, bool) and wanted > context:
        raise RequestError(400, f"max_tokens is {wanted:,}, more than the model's context ({context:,} tokens)")
    if _has_images(body):  # (mlx_lm.server fetches and decodes them first: not rendered here)
        return
    # No tokenizer makes more tokens of a text than its UTF-8 bytes: a prompt that fits by them, with
    # room for the chat template's own tokens, is not tokenized a second time (the generation path does).
    messages = body.get("messages")
    room = TEMPLATE_TOKENS + MESSAGE_TOKENS * (len(messages) if isinstance(messages, list) else 1) \
        + len(json.dumps(body.get("tools") or []))
    if sum(len(t.encode("utf-8")) for t in texts) + room <= context:
        return
    rendered = render(generator, path + "/render", body, served_model)
    n = max(len(r["token_ids"]) for r in (rendered if isinstance(rendered, list) else [rendered]))
    if n > context:
        raise RequestError(400, f"the prompt is {n:,} tokens, longer than the model's context ({context:,} tokens)")


def _context(generator: Any) -> int | None:
    """The served model's context in tokens, from its own config.json: its context length times
    its RoPE scaling factor (YaRN, linear...); None when the config names none (a class default
    is no limit the model states), or it cannot be read. Kept on the model, read once."""
    provider = getattr(generator, "model_provider", None)
    model = getattr(provider, "model", None)
    if model is None:
        return None
    known = getattr(model, "_kvstore_context", False)
    if known is not False:
        return known
    try:
        from kvstore.model.fingerprint import resolve_model_dir

        context = context_of(json.loads((resolve_model_dir(str(provider.model_key[0])) / "config.json").read_text()))
    except Exception:  # (a repo id not in the local cache, no config...: nothing to check against)
        context = None
    try:
        model._kvstore_context = context
    except Exception:
        pass
    return context


def _has_images(body: dict) -> bool:
    messages = body.get("messages")
    return any(isinstance(part, dict) and part.get("type") not in (None, "text")
               for m in (messages if isinstance(messages, list) else []) if isinstance(m, dict)
               for part in (m.get("content") if isinstance(m.get("content"), list) else []))


def _texts(body: dict) -> list[str]:
    """The texts of a request's prompt or messages (what its tokens come from); whatever is not
    text is left for the generation path to refuse."""
    prompt = body.get("prompt")
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)] \
        if isinstance(prompt, list) else []
    messages = body.get("messages")
    for m in messages if isinstance(messages, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        parts = content if isinstance(content, list) else [content]
        texts += [p if isinstance(p, str) else p.get("text") for p in parts if isinstance(p, (str, dict))]
    return [t for t in texts if isinstance(t, str)]


def prompt_tokens(generator: Any, body: dict, served_model: str | None) -> list[int]:
    """The token ids of a prefetch request: `tokens` as given, else those its `messages` or
    `prompt` render to (as a request's would)."""
    given = [k for k in ("messages", "prompt", "tokens") if k in body]
    if len(given) > 1:
        raise RequestError(400, f"give one of messages, prompt or tokens, not {' and '.join(given)}")
    tokens = body.get("tokens")
    if tokens is not None:
        problem = check_tokens(tokens, _vocab_size(generator))
        if problem is not None:
            raise RequestError(400, f"{problem[0]}: {problem[1]}")
        return tokens
    if "messages" in body:
        return render(generator, "/v1/chat/completions/render", body, served_model)["token_ids"]
    if "prompt" in body:
        out = render(generator, "/v1/completions/render", body, served_model)
        if len(out) != 1:
            raise RequestError(400, "prefetch takes one prompt")
        return out[0]["token_ids"]
    others = [key for key in body if key not in ("model", "tenant", "cache_salt")]
    named = (f" (it has {', '.join(did_you_mean(k, ('messages', 'prompt', 'tokens')) for k in others)})"
             if others else "")
    raise RequestError(400, f"the request has none of messages, prompt or tokens{named}")


def _vocab_size(generator: Any) -> int | None:
    """The served model's vocabulary size, when its config says (None: token ids are not checked
    against it)."""
    model = getattr(getattr(generator, "model_provider", None), "model", None)
    args = getattr(model, "args", None)
    for config in (args, getattr(args, "text_config", None)):
        size = config.get("vocab_size") if isinstance(config, dict) else getattr(config, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    return None


def _tokenizer(generator: Any, body: dict, served_model: str | None) -> Any:
    provider = generator.model_provider
    tokenizer = getattr(provider, "tokenizer", None)
    if tokenizer is None:
        raise RequestError(503, "no model is loaded yet")
    wanted = body.get("model")
    loaded = (getattr(provider, "model_key", None) or (None,))[0]
    if wanted not in (None, "default_model", served_model, loaded):
        raise RequestError(404, f"the model {wanted!r} is not loaded here: render serves the loaded model, "
                                f"{served_model!r}")
    return tokenizer


def _completion_request(*fields: Any) -> Any:
    from mlx_lm.server import CompletionRequest

    return CompletionRequest(*fields)


def _prompt_of(generator: Any, tokenizer: Any, request: Any, args: Any) -> list[int]:
    """The tokens mlx_lm.server's generation path prefills for `request`."""
    try:
        prompt = generator._tokenize(tokenizer, request, args)[0]
    except Exception as e:  # a template that refuses the messages, say
        raise RequestError(400, f"cannot render the request: {type(e).__name__}: {e}") from None
    if any(t < 0 for t in prompt):
        raise RequestError(400, "requests with images are not rendered")
    return [int(t) for t in prompt]


def _sampling(generator: Any, body: dict) -> dict:
    args = generator.cli_args
    stop = body.get("stop") or []
    return {"max_tokens": body.get("max_completion_tokens") or body.get("max_tokens", args.max_tokens),
            "temperature": body.get("temperature", args.temp), "top_p": body.get("top_p", args.top_p),
            "top_k": body.get("top_k", args.top_k), "min_p": body.get("min_p", args.min_p),
            "stop": [stop] if isinstance(stop, str) else stop}


# -- warm the most-hit prompts ------------------------------------------------------------------

def most_hit(index: Index, ns: bytes, n: int) -> list[list[Row]]:
    """The chains (root first) of the `n` most-hit prompt ends of namespace `ns`, in the shared
    namespace only (records with a tenant tag are left out). A prompt end is a record hit more
    often than any of its children; one that lies within a chain already chosen is no prompt of
    its own (a system prompt's first chunk, which other prompts restored from too), and a chain
    that extends one chosen takes its place: each chain is a different prompt."""
    rows = {r.hash: r for r in index.rows(ns) if r.kind != CHECKPOINT and not r.bad
            and getattr(r, "tenant", None) is None}
    most_child: dict[bytes, int] = {}
    for r in rows.values():
        most_child[r.parent] = max(most_child.get(r.parent, 0), r.hits)
    ends = sorted((r for r in rows.values() if r.hits > most_child.get(r.hash, 0)),
                  key=lambda r: (-r.hits, -(r.depth or 0), r.hash))
    chains: list[list[Row]] = []
    within: set[bytes] = set()  # every record of the chosen chains
    for end in ends:
        if len(chains) >= n:
            break
        if end.hash in within:
            continue
        chain, h = [], end.hash
        while h in rows:
            chain.append(rows[h])
            h = rows[h].parent
        if h != ns:  # a chain that does not reach its root (a record is missing): skipped
            continue
        held = {r.hash for r in chain}
        chains = [c for c in chains if c[-1].hash not in held] + [chain[::-1]]
        within |= held
    return chains


def chain_tokens(root, chain: list[Row]) -> np.ndarray | None:
    """The token ids of a chain, from its blobs (None if one cannot be read)."""
    parts = []
    for row in chain:
        try:
            with open_blob(root, row.hash, size=row.size, checksum=row.checksum) as blob:
                parts.append(blob.tokens())
        except (BlobError, OSError):
            return None
    return np.concatenate(parts) if parts else None


def warm_top(cache: PersistentPromptCache, n: int) -> dict:
    """Load the `n` most-hit prompts of the served model into the memory tier, while it has room.
    Returns what was done; says it in one log line."""
    done = {"asked": n, "prompts": 0, "tokens": 0, "skipped": 0}
    store = cache.store
    binding = cache.bind_served()
    if n <= 0 or store.index is None or not isinstance(binding, Binding):
        return done
    memory = store.memory
    for chain in most_hit(store.index, binding.plain.ns, n):
        if memory.nbytes + sum(r.size for r in chain) > memory.capacity:
            done["skipped"] += 1  # it would push out what was warmed before it
            continue
        tokens = chain_tokens(store.blob_root, chain)
        if tokens is None:
            done["skipped"] += 1
            continue
        got = cache.prefetch(None, tokens.tolist(), binding=binding, request=False)
        done["prompts"] += got.get("in_ram", 0) == len(tokens)
        done["tokens"] += got.get("loaded", 0)
    cache.counters["warmed_prompts"] = done["prompts"]
    log.info("kvstore: warmed %s of the %d most hit into RAM (%s tokens; memory tier %s of %s)%s",
             plural(done["prompts"], "prompt"), n, done["tokens"], format_size(memory.nbytes),
             format_size(memory.capacity), f"; {done['skipped']} left out (no room, or unreadable)"
             if done["skipped"] else "")
    return done
