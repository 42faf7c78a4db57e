"""A prompt's cache before generation, and what to store after it.

`prompt_cache` is where a generation starts: the stored prefix, with the rule hybrid models need
(prefill all but the last token, so that recurrent layers have a checkpoint to resume from).
`held_length` is the one rule for how many tokens a cache really holds after generation (the
`kvstore generate` command and the server adapter both store exactly those), and
`insert_generated` stores a prompt and its generated tokens by it.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np


def prompt_cache(mc, tokens: Sequence[int]) -> tuple[list, list[int], int]:
    """(cache, tokens left for generation, tokens reused from the store) for a prompt.

    Recurrent layers restore only where a checkpoint was stored, and the insert after
    generation stores one after the generated text: so the prompt (but its last token) is
    prefilled and stored first, which lets the same prompt resume from the store next time.
    """
    if mc.checkpointed and len(tokens) > 1:
        cache, reused, _ = mc.prefill(tokens[:-1], durable=False)  # a request: admitted as any
        if cache is not None:
            return cache, [int(tokens[-1])], reused
    cache, rest = mc.fetch(tokens)
    return cache, rest, len(tokens) - len(rest)


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


def insert_generated(mc, prompt: Sequence[int], generated: Sequence[int], cache: list) -> int:
    """Insert exactly the tokens the cache has processed, the prompt and what was generated;
    returns how many: 0 (nothing inserted) when the cache does not say (see `held_length`)."""
    sequence = np.concatenate([np.asarray(prompt, dtype=np.int32), np.asarray(generated, dtype=np.int32)])
    held = held_length((codec.offset(layer) for codec, layer in zip(mc.codecs, cache)), len(sequence))
    if held is None:
        return 0
    mc.insert(sequence[:held], cache)
    return held
