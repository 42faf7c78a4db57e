"""A restored run's first step against the canary its record keeps: a check at no extra cost.

When a stored prompt is asked for again, the restore gives all of it but its last token, and the
first generation step runs that token from there: exactly the step whose logits the prompt's
canary keeps (`kvstore.canary`: the same position, the same token, the same stored K/V). So the
step that runs anyway can be compared with the canary. A canary that does not reproduce means
the restored K/V are not what was stored (damage no checksum saw: a record rewritten with its
checksums, a bad disk or RAM), in any of the records the restore used: each of them is
quarantined as a damaged one is (the next request computes the prompt again), counted
(`stats()["canary_mismatches"]`) and named once in a warning.
K/V quantized on disk (`disk_kv_bits`), or by mlx-lm out of exact mode (`serve --kv-bits`: a cold
run computes the prompt before it quantizes, a restored one after), are judged within `verify
--exact`'s bounds for them, and only reported: such a cache never restores exactly what the
canary's run computed.
"""

from __future__ import annotations

import logging
from typing import Sequence

from kvstore import canary as canaries
from kvstore.certify.compare import KV_BITS_BOUNDS, disk_bits, mlx_bits
from kvstore.model.prefill import host_logprobs

log = logging.getLogger("kvstore")
_warned: set[bytes] = set()  # records this process warned of


def check_first_step(mc, tokens: Sequence[int], logprobs, *, restore: tuple | None = None,
                     then: str | None = None) -> canaries.Check | None:
    """The first generation step after this thread's fetch of `tokens` (or after the restore
    `restore`, `mc.last_restore()` of a fetch made earlier) gave `logprobs` (the model's own:
    before a logit bias or a penalty changes them): compare them with the canary of the record
    the restore ended with, when that step is the canary's. `then`: what the caller does about a
    mismatch, for the warning (else: the next request computes the prompt again).
    None when it is not (or no canary is kept); else the check. Never raises."""
    try:
        return _check(mc, tokens, logprobs, restore, then)
    except Exception as e:
        log.warning("kvstore: a first step was not compared with its canary (%s: %s)", type(e).__name__, e)
        return None


def _check(mc, tokens: Sequence[int], logprobs, restore: tuple | None,
           then: str | None) -> canaries.Check | None:
    found = mc.restored_canary(tokens, restore)
    if found is None:
        return None
    used, kept = found
    record = used[-1]
    if kept.at != len(tokens) - 1 or kept.token != int(tokens[-1]):
        return None
    lossy = disk_bits(mc) or (None if mc.exact else mlx_bits(mc))
    tolerance = KV_BITS_BOUNDS[8 if lossy >= 8 else 4][1] if lossy else canaries.TOLERANCE
    got = canaries.check(kept, host_logprobs(logprobs), tolerance)
    if got.ok:
        return got
    mc.backing.counters.canary_mismatches += 1
    what = (f"kvstore: the first step after restoring record {record.hex()} ({len(tokens) - 1} tokens) does not "
            f"give the canary it keeps: {got.reason}")
    if lossy:
        what += f" (K/V quantized to {lossy} bits: reported, the record is kept)"
    else:
        # The canary cannot tell which of the records the restore used holds the damage: none of
        # them is served again, and the next request computes the whole prompt again.
        for h in used:
            mc.quarantine(h, f"record {h.hex()}: a canary restored through it does not reproduce "
                             f"(record {record.hex()}: {got.reason})")
        what += (f"; the {len(used)} record{'s' if len(used) != 1 else ''} it was restored from "
                 f"{'are' if len(used) != 1 else 'is'} quarantined, "
                 f"{then or 'the next request computes the prompt again'}")
    if record not in _warned:
        _warned.add(record)
        log.warning(what)
    return got
