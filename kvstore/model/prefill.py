"""Processing a prompt into a cache, and storing it as it goes: the one place prompts are prefilled.

mlx-lm prefills a prompt in `prefill_step_size` pieces from wherever its cache starts, and leaves
the last token to the first generation step, whose logits give the first token. kvstore does the
same (`run`), and keeps the top of those logits as the prompt's canary (`kvstore.canary`), in the
header of the record that stores the prompt's end.

The store's `exact_prefill` picks one of two modes:

- **off**: a prompt resumes from the longest stored prefix (token-exact). `prefill` (what `warm`
  runs) then processes up to each chunk boundary, storing each chunk as it is done, and the last
  token alone; the whole prompt is stored, with its canary.
- **exact** (`exact_prefill=S`): the model's records are S tokens (its chunk size) and every step
  is one record: S tokens from a multiple of S, the same operations on the same shapes in a cold
  run and a restored one. The tokens after the last full step, but the last token, are one step
  (a cold run computes them so too) and are stored as a tail; the last token is the first
  generation step (or, in `prefill`, one step of its own for the canary). `fetch` restores at a
  multiple of S, or at a stored tail that ends where the prompt's last token starts (the tail
  was then computed as this prompt's cold run computes it). Nothing computed after the prompt
  (generated tokens, decode steps) is stored: a later prompt recomputes those in full steps.

`prompt_cache` is where a generation starts; `prefill` stores a prompt for later. After a
generation, `held_length` is the one rule for how many tokens a cache really holds (`kvstore
generate` and the server adapter both store exactly those), and `insert_generated` stores them.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple, Sequence

import mlx.core as mx
import numpy as np

from kvstore import canary as canaries
from kvstore.canary import Canary
from kvstore.errors import InvalidInputError
from kvstore.model.jsonl import check_vocab
from kvstore.model.tokens import arrays_of, as_tokens

#: Default for `prefill`: a recurrent-state checkpoint every this many chunks (docs/library.md).
CHECKPOINT_EVERY = 4


def process(model, cache: list, tokens: Sequence[int], ends: Sequence[int]) -> None:
    """Run `tokens` through the model into `cache` in pieces ending at each of `ends` (positions
    in `tokens`, increasing, the last `len(tokens)`), evaluating the cache after each."""
    pos = 0
    for end in ends:
        if end > pos:
            model(mx.array(np.asarray(tokens[pos:end], dtype=np.int32))[None], cache=cache)
            mx.eval(arrays_of(cache))
            pos = end


def last_step(model, cache: list, token: int) -> mx.array:
    """One step of one token, as mlx-lm's generation takes its first: the log-probabilities of
    the next token (the logits less their logsumexp, in the logits' dtype), evaluated."""
    logits = model(mx.array([[int(token)]]), cache=cache)[:, -1, :]
    logprobs = (logits - mx.logsumexp(logits, keepdims=True)).squeeze(0)
    mx.eval(logprobs, arrays_of(cache))
    return logprobs


def run(model, cache: list, tokens: Sequence[int], step: int | None = None) -> mx.array:
    """Process `tokens` as mlx-lm's generation does: all but the last in pieces of `step` (one
    piece when None), then the last alone. Returns the log-probabilities after it."""
    n = len(tokens) - 1
    process(model, cache, tokens[:n], _ends(0, n, step) if step else [n])
    return last_step(model, cache, tokens[n])


def model_tokens(model, tokens) -> np.ndarray:
    """`as_tokens(tokens)`, each of them an id of `model`'s vocabulary (as its config says): an id
    past it makes the embedding read outside its table, which crashes the process."""
    toks = as_tokens(tokens)
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    problem = check_vocab(toks, size) if isinstance(size, int) and size > 0 else None
    if problem is not None:
        raise InvalidInputError(f"{problem[0]}: {problem[1]}")
    return toks


def host_logprobs(logprobs) -> np.ndarray:
    """A step's log-probabilities (or logits) as a numpy array: from an mlx array of any float
    dtype (bfloat16 too, which numpy has not), a numpy array or a list, as an own server has them."""
    if isinstance(logprobs, mx.array):
        logprobs = logprobs.astype(mx.float32)
    return np.asarray(logprobs, dtype=np.float64)


def canary_of(at: int, token: int, logprobs) -> canaries.Canary | None:
    """The canary of a step's log-probabilities (`host_logprobs`); None when they are not numbers
    (NaN or +inf: a model that overflowed), which no canary can hold: the records are then stored
    without one, rather than not at all (a header with such a canary is refused)."""
    canary = canaries.of(at, token, host_logprobs(logprobs))
    return canary if all(v <= 0 for v in canary.logprobs) else None


def _ends(start: int, stop: int, step: int) -> list[int]:
    """Piece ends from `start` to `stop`: every multiple of `step`, then `stop`."""
    return [*range((start // step + 1) * step, stop, step), stop] if stop > start else []


class Start(NamedTuple):
    """Where a generation starts: the cache, the tokens left for generation, the tokens reused
    from the store, and (exact mode) the insert of the prompt's end, waiting for the canary
    of the first generation step (`Pending.submit`)."""

    cache: list
    rest: list[int]
    reused: int
    hold: object | None = None


def prompt_cache(mc, tokens: Sequence[int], *, restore: bool = True) -> Start:
    """The cache a generation starts from, and what is left for it.

    Exact mode: the stored prefix (at a multiple of S), the prompt but its last token processed
    in full steps and stored, the last token left: `hold` stores the prompt's end when given the
    first step's canary. Recurrent layers (off): the same without the rounding (they restore only
    where a checkpoint is, and the one at the last token but one lets the same prompt resume next
    time). Otherwise the longest stored prefix, the rest left to mlx-lm. `restore=False`: as a
    cold run starts, from a fresh cache (nothing is looked up)."""
    toks = model_tokens(mc.model, tokens)
    cache, rest = mc.fetch(toks) if restore else (mc.new_cache(), toks.tolist())
    reused = len(toks) - len(rest)
    if not (mc.exact or mc.checkpointed) or len(toks) < 2 or reused >= len(toks) - 1:
        return Start(cache, rest, reused)
    stop = len(toks) - 1
    _steps(mc, toks, cache, reused, stop, step=None, checkpoint_every=CHECKPOINT_EVERY, durable=False,
           cache_type="assistant")
    if mc.exact:
        return Start(cache, [int(toks[-1])], reused, mc.insert_later(toks[:stop], cache, checkpoint=True))
    mc.insert(toks[:stop], cache, checkpoint=True)  # a request: admitted as any
    return Start(cache, [int(toks[-1])], reused)


def prefill(mc, tokens, *, step: int | None = None, checkpoint_every: int = CHECKPOINT_EVERY,
            pin: bool = False, progress: Callable[[int], None] | None = None, durable: bool = True,
            cache_type: str = "assistant") -> tuple[list | None, int, int]:
    """`ModelCache.prefill`: make sure the cache of `tokens` is stored, computing only what is
    missing (see its docstring); the last token is one step of its own, whose logits are the
    prompt's canary."""
    for name, value, least in (("step", step, 1), ("checkpoint_every", checkpoint_every, 0)):
        if not ((value is None and name == "step")
                or (isinstance(value, int) and not isinstance(value, bool) and value >= least)):
            raise InvalidInputError(f"{name}: give a whole number of {'tokens' if least else 'chunks'}, "
                                    f"{least} or more{' (or None)' if least else ''}, not {value!r:.30}")
    toks = model_tokens(mc.model, tokens)
    if len(toks) == 0:
        raise InvalidInputError("prefill needs at least one token")
    if mc.exact and step not in (None, mc.chunk_size):
        raise InvalidInputError(f"exact_prefill steps are {mc.chunk_size} tokens: step={step} would "
                                "compute what a cold run does not")
    if len(mc.stored_part(toks)) and mc.already_stored(toks, pin=pin, durable=durable, cache_type=cache_type):
        return None, len(toks), 0
    cache, rest = mc.fetch(toks)
    reused = len(toks) - len(rest)
    stop = len(toks) - 1  # the last token is a step of its own
    unreported = _steps(mc, toks, cache, reused, stop, step=step, checkpoint_every=checkpoint_every,
                        durable=durable, cache_type=cache_type, progress=progress)
    kept = dict(pin=pin, checkpoint=True, durable=durable, cache_type=cache_type)
    pending = mc.insert_later(toks[:stop], cache, **kept) if mc.exact and stop > 0 else None
    if reused < stop and mc.resume_records(toks):
        # A fetch leaves the last token to compute, where a recurrent layer has no checkpoint
        # (or a window no data): this lets the same prompt, asked again, resume (as `prompt_cache`).
        mc.insert(toks[:stop], cache, **kept)
    logprobs = last_step(mc.model, cache, toks[stop])
    canary = canary_of(stop, int(toks[stop]), logprobs)
    if pending is not None:
        pending.submit(canary)
    elif not mc.exact:
        mc.insert(toks, cache, canary=canary, **kept)
    if progress is not None:  # after the insert: a stop raised from it leaves the prompt stored whole
        progress(unreported + 1)
    return cache, reused, len(toks) - reused


def _steps(mc, toks: np.ndarray, cache: list, pos: int, stop: int, *, step: int | None,
           checkpoint_every: int, durable: bool, cache_type: str,
           progress: Callable[[int], None] | None = None) -> int:
    """Process `toks[pos:stop]` to each chunk boundary (or `step` at a time), storing after each
    piece but the last (the caller stores the end, with what the next step gives). `progress`
    hears of each piece once it is stored; returns the tokens of the last piece, not yet told."""
    C = mc.chunk_size
    last_full = stop // C * C  # exact mode: the end of the last full step, where the next prompt resumes
    while pos < stop:
        end = min(stop, pos + step) if step else min(stop, (pos // C + 1) * C)
        process(mc.model, cache, toks[pos:end], [end - pos])
        if end == stop:
            return end - pos
        at_boundary = end % C == 0 and checkpoint_every > 0 and (end // C) % checkpoint_every == 0
        mc.insert(toks[:end], cache, checkpoint=at_boundary or (bool(mc.exact) and end == last_full),
                  durable=durable, cache_type=cache_type)
        if progress is not None:
            progress(end - pos)
        pos = end
    return 0


# -- after a generation ------------------------------------------------------------------------

def held_length(offsets: Iterable[int | None], n: int) -> int | None:
    """How many of the `n` tokens given a cache holds, from its layers' offsets (None for a layer
    that does not count, like a recurrent one); None when it cannot be told (layers disagree, or
    they hold none or more than `n`).

    The model runs every layer on every token, so the layers that count say for the whole cache;
    when none does, it holds all `n`. mlx_lm.server hands over every generated token, the last
    of which the model never processed: its cache is then one token short.
    """
    counted = {o for o in offsets if isinstance(o, int) and not isinstance(o, bool)}
    if not counted:
        return n
    if len(counted) > 1:
        return None
    (held,) = counted
    return held if 0 < held <= n else None


def insert_generated(mc, prompt: Sequence[int], generated: Sequence[int], cache: list,
                     canary: Canary | None = None) -> int:
    """Insert exactly the tokens the cache has processed, the prompt and what was generated
    (with the canary of the first generation step); returns how many: 0 (nothing inserted)
    when the cache does not say (see `held_length`). In exact mode nothing is: the prompt was
    stored as it was prefilled, and what a generation computes is not what a cold prefill does."""
    if mc.exact:
        return 0
    sequence = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(generated, dtype=np.int32)])
    held = held_length((codec.offset(layer) for codec, layer in zip(mc.codecs, cache)), len(sequence))
    if held is None:
        return 0
    mc.insert(sequence[:held], cache, canary=canary)
    return held
