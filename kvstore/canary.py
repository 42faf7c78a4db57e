"""A canary: a small fingerprint of the logits one step gave, kept in a record's blob header.

When a prompt has been processed and generation starts, the model's first step turns the prompt's
last token into logits: the step every generation runs anyway. kvstore keeps the top of those
logits with the record that stores the prompt's end, so that anyone holding the record can later
replay that step from the stored K/V and see whether it still gives the same answer
(`kvstore verify --exact`, and packs, which carry their canaries).

A canary is JSON in the blob header field `x-canary` (`storage.blobformat`'s extension point):

    {"v": 1, "at": 1064, "token": 10, "ids": [8 token ids, best first],
     "logprobs": [their log-probabilities, rounded to float16]}

- `at`: the position (0-based, in the whole prompt) of the token the step processed, alone, with
  the K/V of the `at` tokens before it; `token`: that token's id. The logits are those of the
  token after it. The record holding the canary is the one that holds token `at`, or the one that
  ends just before it.
- `ids`/`logprobs`: the 8 largest log-probabilities (the logits less their logsumexp, as mlx-lm
  hands them out), best first, as float16: about 180 bytes of JSON. A canary of a later version (`"v"`
  above 1) is kept and not read.

To check one: restore the prompt's first `at` tokens, run `token` as one step, and call
`check(canary, logprobs)`. Same machine, same kernels: the logprobs are bitwise those of the
canary (float16 rounding aside). Elsewhere they differ by kernel noise, within `tolerance`.

Only numpy here: maintenance commands read headers without mlx.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from kvstore.errors import InvalidInputError

VERSION = 1
TOP = 8  # token ids kept
TIE_MARGIN = 0.02  # a top-1 lead smaller than this (in logits) may flip on kernel noise alone
TOLERANCE = 0.05  # largest |logprob difference| of a kept id that is still the same answer
#: The same, for a step replayed from K/V quantized on disk (`disk_kv_bits`) against a canary
#: taken at full precision: twice the largest logit difference the demo models showed (0.125 at 8
#: bits, 0.75 at 4; docs/kv8.md). Wide: a change to the K/V that moves the logits less passes it.
QUANTIZED_TOLERANCE = {8: 0.25, 4: 1.5}
_MAX_TEXT = 1024


@dataclass(frozen=True)
class Canary:
    """The top `TOP` log-probabilities one step gave (see the module docstring)."""

    at: int
    token: int
    ids: tuple[int, ...]
    logprobs: tuple[float, ...]

    @property
    def margin(self) -> float:
        """How far the best id led the second, in log-probability (= logit) units."""
        return self.logprobs[0] - self.logprobs[1] if len(self.logprobs) > 1 else float("inf")

    def text(self) -> str:
        """The header field's text."""
        return json.dumps({"v": VERSION, "at": self.at, "token": self.token, "ids": list(self.ids),
                           "logprobs": list(self.logprobs)}, separators=(",", ":"))


def of(at: int, token: int, logprobs: Any) -> Canary:
    """The canary of one step: `logprobs` are its log-probabilities (or logits: they are
    normalised here), a 1-D array of the vocabulary, numpy or anything `np.asarray` takes."""
    lp = np.asarray(logprobs, dtype=np.float64).reshape(-1)
    if lp.size < 2:
        raise ValueError("a canary needs the logits of at least two tokens")
    lp = lp - _logsumexp(lp)
    k = min(TOP, lp.size)
    top = np.argpartition(-lp, k - 1)[:k]
    top = top[np.lexsort((top, -lp[top]))]  # best first; ties by id, so the order is stable
    return Canary(int(at), int(token), tuple(int(i) for i in top),
                  tuple(float(np.float16(v)) for v in lp[top]))


def for_tokens(canary: object, tokens: np.ndarray) -> None:
    """Refuse (`InvalidInputError`, naming what is wrong) a `canary` given with the insert of
    `tokens` that is not a step of them: not a `Canary`, at a position past the token after
    them, or of another token than theirs at its position. None passes."""
    if canary is None:
        return
    if not isinstance(canary, Canary):
        raise InvalidInputError(f"canary: give a kvstore.canary.Canary (kvstore.canary.of(at, token, logprobs)) "
                                f"or None, not {type(canary).__name__}")
    if not 0 <= canary.at <= len(tokens):
        raise InvalidInputError(f"canary: its step is at position {canary.at}, past the {len(tokens)} tokens "
                                "inserted and the one after them")
    if canary.at < len(tokens) and canary.token != int(tokens[canary.at]):
        raise InvalidInputError(f"canary: its step is of token {canary.token} at position {canary.at}, but the "
                                f"tokens inserted have {int(tokens[canary.at])} there: a canary of another prompt")


def parse(text: str) -> Canary | None:
    """A canary from its header text; ValueError naming what is wrong (the header extension's
    validator: a damaged canary makes the blob damaged, as any bad header field does). A canary
    of a later version is kept and not read: None."""
    if not isinstance(text, str) or len(text) > _MAX_TEXT:
        raise ValueError("a canary is a short JSON object")
    try:
        raw = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ValueError(f"not JSON ({e})") from None
    version = raw.get("v") if isinstance(raw, dict) else None
    if type(version) is int and version > VERSION:
        return None
    if version != VERSION:
        raise ValueError(f"not a version {VERSION} canary")
    at, token, ids, lps = raw.get("at"), raw.get("token"), raw.get("ids"), raw.get("logprobs")
    if not (_whole(at) and _whole(token) and isinstance(ids, list) and isinstance(lps, list)):
        raise ValueError("its at, token, ids or logprobs are missing or not numbers")
    if not (2 <= len(ids) <= TOP and len(lps) == len(ids) and all(map(_whole, ids))):
        raise ValueError(f"it needs 2 to {TOP} token ids, each with a log-probability")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 0 for v in lps):
        raise ValueError("its log-probabilities must be numbers <= 0")
    if any(a < b for a, b in zip(lps, lps[1:])) or len(set(ids)) != len(ids):
        raise ValueError("its ids must be distinct, best first")
    return Canary(at, token, tuple(ids), tuple(float(v) for v in lps))


def _whole(v: object) -> bool:
    return type(v) is int and 0 <= v < 1 << 31


def _logsumexp(x: np.ndarray) -> float:
    m = float(np.max(x))
    return m + float(np.log(np.sum(np.exp(x - m))))


@dataclass(frozen=True)
class Check:
    """What one replay of a canary gave: `ok` unless the answer moved (`reason` says how).

    `max_abs`: the largest |difference| of the canary's log-probabilities (its ids, in the replay's
    logits); `top1`: the replay's best id is the canary's; `tie`: the canary's lead was under
    `TIE_MARGIN`, so a different best id is kernel noise, not damage."""

    ok: bool
    max_abs: float
    top1: bool
    tie: bool
    reason: str = ""


def check(canary: Canary, logprobs: Any, tolerance: float = TOLERANCE) -> Check:
    """Compare the replay of `canary`'s step (`logprobs` or logits of the whole vocabulary, 1-D)
    with it. The answer moved when the best id differs (and the canary's lead was not a tie) or
    a kept id's log-probability moved by more than `tolerance` plus its float16 rounding."""
    lp = np.asarray(logprobs, dtype=np.float64).reshape(-1)
    if max(canary.ids) >= lp.size:
        return Check(False, float("inf"), False, False, f"token id {max(canary.ids)} is past the vocabulary")
    lp = lp - _logsumexp(lp)
    mine = lp[list(canary.ids)]
    want = np.asarray(canary.logprobs, dtype=np.float64)
    slack = np.abs(want) * 2.0 ** -11  # float16's rounding of the kept values
    diff = np.abs(mine - want)
    max_abs = float(diff.max())
    top1 = int(np.argmax(lp)) == canary.ids[0]
    tie = canary.margin < TIE_MARGIN
    if not top1 and not tie:
        return Check(False, max_abs, top1, tie, f"the best token is {int(np.argmax(lp))}, the canary's {canary.ids[0]}")
    if bool(np.any(diff > tolerance + slack)):
        return Check(False, max_abs, top1, tie, f"log-probabilities moved by up to {max_abs:.3g}")
    return Check(True, max_abs, top1, tie)


def holder(starts_and_ends: Sequence[tuple[int, int]], at: int) -> int | None:
    """Which of these records (their token ranges [start, end), in order) holds a canary at
    `at`: the one holding token `at`, else the one ending just before it; None if neither."""
    for i, (start, end) in enumerate(starts_and_ends):
        if start <= at < end:
            return i
    for i, (start, end) in enumerate(starts_and_ends):
        if end == at and end > start:
            return i
    return None
