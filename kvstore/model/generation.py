"""What to store after a generation.

`held_length` is the one rule for how many tokens a cache really holds after generation (the
`kvstore generate` command and the server adapter both store exactly those), and
`insert_generated` stores a prompt and its generated tokens by it. Where a generation starts is
`model.prefill.prompt_cache`.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import numpy as np

from kvstore.canary import Canary


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
