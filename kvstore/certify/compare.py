"""One stored prompt against a cold run of it: K/V, next-token logits, greedy tokens, canaries.

The restored run fetches the prompt and one more token from the store (so every stored token is
restored where the store's rules allow) and runs what is left as generation does
(`model.prefill.run`: in the store's steps in exact mode). The cold run processes the same tokens
from an empty cache, one step per stored record (the steps that stored them: in exact mode the
full steps and the tail), then the last token alone. Both then decode `GREEDY` tokens greedily.
At the end of every record but the last, the cold run's cache is compared with what the store
restores there (every restore point a query that branches off the prompt could use: in exact
mode the multiples of S; a hybrid model's checkpoints). Every canary of the prompt's records is replayed: its prefix restored, its token run as one step.
"""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from kvstore import canary as canaries
from kvstore import keys
from kvstore.certify.prompts import StoredPrompt
from kvstore.certify.report import GREEDY, Bounds, PromptCheck, judge
from kvstore.model.prefill import last_step, process, run
from kvstore.restore.codecs import QuantizedKVCodec, RotatingCodec
from kvstore.restore.quant import layout_bits

DEFAULT_STEP = 2048  # mlx-lm's prefill_step_size, for what a token-exact store leaves to compute
# K/V quantized on disk (docs/kv8.md): the restored K/V within this share of each tensor's largest
# |value| (one quantization step of the widest group, with the scales' and biases' own rounding:
# up to 0.027 measured at 8 bits on the demo models, 0.14 at 4), and next-token logits within
# twice what the demo models showed (`canary.QUANTIZED_TOLERANCE`).
KV_BITS_BOUNDS = {bits: (kv, canaries.QUANTIZED_TOLERANCE[bits]) for bits, kv in ((8, 1 / 16), (4, 1 / 3))}


def bounds_for(mc, disk_kv_bits: int | None) -> Bounds:
    """What counts as the same for the prompts of model cache `mc` (see `report`)."""
    lossy = disk_kv_bits if disk_bits(mc) else None
    if lossy:
        kv, logits = KV_BITS_BOUNDS[lossy]
        return Bounds(f"{lossy}-bit K/V on disk, judged against its bounds", exact=False, kv=kv, logprobs=logits,
                      canary=logits, greedy=False, tie=logits, kv_after=False)
    if mc.exact:
        return Bounds(f"exact mode, steps of {mc.exact}", exact=True)
    quantized = mlx_bits(mc)
    if quantized:  # what mlx-lm computed before it quantized, against a cold run quantized from the start
        kv, logits = KV_BITS_BOUNDS[8 if quantized >= 8 else 4]
        return Bounds(f"{quantized}-bit K/V quantized by mlx-lm, judged against its bounds", exact=False, kv=kv,
                      logprobs=logits, canary=logits, greedy=False, tie=logits, kv_after=False)
    dtype = str((mc.layout.get("param_dtypes") or ["float32"])[0])
    low = "bfloat16" in dtype or "float16" in dtype
    return Bounds("token-exact reuse: exact mode off", exact=False, kv=2.0 ** -6 if low else 1e-4,
                  logprobs=0.1 if low else 1e-3)


def mlx_bits(mc) -> int | None:
    """The bits of model cache `mc`'s caches quantized by mlx-lm (`QuantizedKVCache`: `bind(kv_bits=...)`,
    `serve --kv-bits`), or None. Out of exact mode mlx-lm computes a prompt with a plain cache and
    quantizes it after (at its first generation step past `--quantized-kv-start`), where a cold run
    here quantizes it from token 0: the two differ by the quantization, as K/V quantized on disk do."""
    found = [leaf.bits for codec in mc.codecs for _, leaf in codec.leaves("") if isinstance(leaf, QuantizedKVCodec)]
    return min(found) if found else None


def disk_bits(mc) -> int | None:
    """The bits K/V of model cache `mc` are quantized to on disk (`disk_kv_bits`), or None."""
    bits = layout_bits(mc.layout)
    return bits if bits in KV_BITS_BOUNDS else None


def check_prompt(mc, prompt: StoredPrompt, b: Bounds) -> PromptCheck:
    """Compare one stored prompt with a cold run of it (see the module docstring)."""
    started = time.perf_counter()
    c = PromptCheck(prompt.leaf.hex(), len(prompt.tokens))
    if prompt.damaged:
        c.partial = prompt.damaged
    if len(prompt.tokens) == 0:
        return judge(c, b)
    n = len(prompt.tokens)
    last = next((k for k in prompt.canaries if k.at == n), None)
    step = mc.exact or DEFAULT_STEP
    query = np.append(prompt.tokens, np.int32(last.token if last else prompt.tokens[-1]))
    restored, rest = mc.fetch(query)
    c.restored = len(query) - len(rest)
    if c.restored == 0:  # then both runs are cold: the store was not put to the test
        c.notes.append("nothing of it restores (a record the restore cannot use): compared cold with cold")
    mine = run(mc.model, restored, rest, step)
    cold = mc.new_cache()
    _cold_through_restore_points(c, mc, prompt, cold, b)
    theirs = last_step(mc.model, cold, int(query[n]))
    _compare_kv(c, mc, restored, cold, n + 1, c.restored, at=c.restored, prompt=prompt, bound=b.kv)
    c.restore_points += c.restored > 0
    a, z = _host(mine), _host(theirs)
    c.logprobs = float(np.max(np.abs(a - z)))
    c.top1 = int(np.argmax(a)) == int(np.argmax(z))
    c.margin = _lead(z)
    ours, _ = _greedy(mc.model, restored, mine)
    ref, leads = _greedy(mc.model, cold, theirs)
    c.greedy = next((i for i, (x, y) in enumerate(zip(ours, ref)) if x != y), GREEDY)
    c.greedy_tie = c.greedy < GREEDY and leads[c.greedy] < b.tie
    for k in prompt.canaries:
        c.canaries += 1
        got = canaries.check(k, a if k is last else _replay(mc, prompt, k, step), b.canary)
        c.canaries_ok += got.ok
        if not got.ok:
            c.notes.append(f"canary at token {k.at}: {got.reason}")
    c.seconds = time.perf_counter() - started
    return judge(c, b)


def _cold_through_restore_points(c: PromptCheck, mc, prompt: StoredPrompt, cold: list, b: Bounds) -> None:
    """Process the prompt cold into `cold`, one step per stored record, and at the end of every
    record but the last compare the cold cache with what the store restores there: a query that
    branches off the prompt after that record restores exactly this (a sliding window's K/V
    before the prompt's last window, a recurrent checkpoint before its end), which the restore
    of the whole prompt never reads. A record end the store cannot restore at (no checkpoint
    there) is no restore point; the one it restores at instead is checked at its own end. Models
    with full attention only skip this: the whole prompt's restore compares the same bytes."""
    pos, n, own = 0, len(prompt.tokens), _branches_read_more(mc)
    for end in prompt.ends:
        process(mc.model, cold, prompt.tokens[pos:end], [end - pos])
        pos = end
        if end >= n or not own:
            continue
        query = prompt.tokens[: end + 1]  # this prefix and the prompt's next token: restores [0, end)
        restored, rest = mc.fetch(query)
        if len(query) - len(rest) == end:
            _compare_kv(c, mc, restored, cold, end, end, at=end, prompt=prompt, bound=b.kv)
            c.restore_points += 1


def _replay(mc, prompt: StoredPrompt, k: canaries.Canary, step: int) -> np.ndarray:
    """The log-probabilities of a canary's step: its prefix restored, then its token."""
    query = np.append(prompt.tokens[: k.at], np.int32(k.token))
    cache, rest = mc.fetch(query)
    return _host(run(mc.model, cache, rest, step))


def _branches_read_more(mc) -> bool:
    """Whether a restore at a record end reads what the restore of the whole prompt does not: a
    sliding window's K/V before the prompt's last window, a recurrent state's checkpoint. (What
    full-attention layers restore there is a prefix of what the whole prompt's restore reads and
    compares, from the same records: checking it again costs a read of it and tells nothing.)"""
    return any(leaf.checkpointed or isinstance(leaf, RotatingCodec)
               for codec in mc.codecs for _, leaf in codec.leaves(""))


def _compare_kv(c: PromptCheck, mc, restored: list, cold: list, n: int, until: int, *, at: int,
                prompt: StoredPrompt, bound: float) -> None:
    """Max |difference| of every stored tensor of the two caches (`n` tokens each), split at
    `until`, the restore point: what was read from the store (tokens before it, and a recurrent
    state when all `n` were restored), and what was computed after it. Each tensor's own figures
    go to `c.tensors` (named layer.tensor, with `at`, the restore point they were worst at). Where
    what was read differs by more than `bound` (relative to the tensor's largest value), the
    records of `prompt` it was read from are compared one by one (`_blame`)."""
    for i, (codec, x, y) in enumerate(zip(mc.codecs, restored, cold)):
        mine, theirs = _tensors(codec, x, n), _tensors(codec, y, n)
        for name, (a, origin) in mine.items():
            key = f"{i}.{name}"
            b = _aligned(theirs.get(name), a, origin)
            if b is None:
                c.kv_bitwise, c.kv_after, c.kv_after_rel = False, float("inf"), float("inf")
                c.note_tensor(key, "after", float("inf"), float("inf"), False, at)
                continue
            diff = mx.abs(a.astype(mx.float32) - b.astype(mx.float32))
            scale = max(float(mx.abs(b.astype(mx.float32)).max()) if b.size else 0.0, 1e-30)
            if origin is None:
                cut = a.shape[2] if until >= n else 0
            else:
                cut = max(0, min(a.shape[2], until - origin))
            same = bool(mx.array_equal(a, b).item())
            if not same:
                c.kv_bitwise = False
            for part, attr in ((diff[:, :, :cut], "kv_restored"), (diff[:, :, cut:], "kv_after")):
                if part.size:
                    worst = float(part.max())
                    setattr(c, attr, max(getattr(c, attr), worst))
                    setattr(c, attr + "_rel", max(getattr(c, attr + "_rel"), worst / scale))
                    c.note_tensor(key, attr[3:], worst, worst / scale, same, at)
                    if attr == "kv_restored" and not worst / scale <= bound:  # (a NaN too)
                        _blame(c, prompt, key, diff[:, :, :cut], origin, scale, bound, at)


def _blame(c: PromptCheck, prompt: StoredPrompt, name: str, diff: mx.array, origin: int | None, scale: float,
           bound: float, at: int) -> None:
    """Which stored records hold the restored part of tensor `name` that differs from the cold run's
    (`diff`, its |difference| over the tokens read from the store, the first at `origin`): each
    record's token range compared alone, so that the report names the record to evict. A
    recurrent state (`origin` None) was read from the checkpoint of the record that ends at `at`."""
    if origin is None:
        if at in prompt.ends:
            worst = float(diff.max())
            owner = prompt.hashes[prompt.ends.index(at)]
            c.note_record(keys.checkpoint_hash(owner).hex(), "checkpoint", at, at, name, worst, worst / scale, at)
        return
    start = 0
    for h, end in zip(prompt.hashes, prompt.ends):
        lo, hi = max(start, origin), min(end, origin + diff.shape[2])
        if lo < hi:
            worst = float(diff[:, :, lo - origin : hi - origin].max())
            if not worst / scale <= bound:
                c.note_record(h.hex(), "record", start, end, name, worst, worst / scale, at)
        start = end


def _aligned(theirs: tuple[mx.array, int | None] | None, a: mx.array, origin: int | None) -> mx.array | None:
    """The cold run's tensor over the tokens the restored one holds (a cold sliding window may
    hold more: after a step of many tokens it keeps the window before each of them); None when
    it does not hold them all."""
    if theirs is None:
        return None
    b, start = theirs
    if origin is not None and start is not None and b.ndim == a.ndim and b.ndim >= 3:
        lo = origin - start
        if lo < 0 or lo + a.shape[2] > b.shape[2]:
            return None
        b = b[:, :, lo : lo + a.shape[2]]
    return b if b.shape == a.shape else None


def _tensors(codec, layer, n: int) -> dict[str, tuple[mx.array, int | None]]:
    """A layer's token-axis tensors (name -> array, its first token) and its whole state (first
    token None: computed after the restore point, as a recurrent state is)."""
    out = {name: (a, origin) for name, (a, origin) in codec.deltas(layer, n).items()}
    if isinstance(codec, QuantizedKVCodec):  # packed words, scales, biases: compared as the K/V they hold
        for kind in ("keys", "values"):
            if f"{kind}.0" in out:
                (q, origin), (scales, _), (biases, _) = (out.pop(f"{kind}.{j}") for j in range(3))
                out[kind] = (mx.dequantize(q, scales, biases, group_size=codec.group_size, bits=codec.bits), origin)
    out.update({f"state.{name}": (a, None) for name, a in codec.checkpoint(layer).items()
                if isinstance(a, mx.array) and a.ndim >= 3})
    return out


def _greedy(model, cache: list, logprobs: mx.array) -> tuple[list[int], list[float]]:
    """`GREEDY` tokens decoded greedily from these log-probabilities on, and each step's lead."""
    tokens, leads = [], []
    for i in range(GREEDY):
        lp = _host(logprobs)
        tokens.append(int(np.argmax(lp)))
        leads.append(_lead(lp))
        if i + 1 < GREEDY:
            logprobs = last_step(model, cache, tokens[-1])
    return tokens, leads


def _lead(lp: np.ndarray) -> float:
    top = np.partition(lp, -2)[-2:]
    return float(top[1] - top[0])


def _host(a: mx.array) -> np.ndarray:
    return np.asarray(a.astype(mx.float32), dtype=np.float64)
