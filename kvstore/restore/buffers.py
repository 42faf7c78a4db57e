"""How much freed memory mlx may keep for the next restore: a bounded, visible raise of its
buffer-cache limit.

mlx-cpu keeps only 32 MiB of freed buffers by default: a larger restore's memory goes back to
the OS when its cache is freed, and the next restore page-faults fresh memory (49,632 faults for
a 235 MB cache here, which cost more than reading the bytes). So the restore raises mlx's
process-wide limit to twice the largest restore so far, never above a bound: by default a
quarter of the machine's RAM, or `buffer_cache_bytes` given to `kvstore.open` (0: never raise
it). A quarter, not less: a 32k-token Qwen3-0.6B cache is 3.7 GB, and a bound below one restore
page-faults the rest every time (an eighth of 24 GB: 528,000 faults a restore, 2.9 s where
a raw read of its bytes takes 0.7 s).
On a Mac, where RAM is shared with the GPU, mlx's own limit is already larger and is kept. A
limit someone else set higher is never lowered.

Importing this module imports no mlx (maintenance commands read `held()` for `stats`).
"""

from __future__ import annotations

import os
import sys
import threading

from kvstore.errors import InvalidInputError

RAM_SHARE = 4  # the default bound is 1/RAM_SHARE of the machine's RAM
_bound: int | None = None  # bytes set by `set_bound`; None: the default
_raised = 0  # the limit this module set last (0: it never raised it)
_before: int | None = None  # mlx's limit before this module first raised it
LOCK = threading.Lock()  # held around every change of mlx's limit (see kvstore.restore.alloc)


def ram_bytes() -> int:
    """The machine's RAM in bytes (0 when the OS cannot say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def bound() -> int:
    """The most this module lets mlx's buffer cache hold: `buffer_cache_bytes`, else RAM / 4."""
    return _bound if _bound is not None else ram_bytes() // RAM_SHARE


def set_bound(nbytes: int | None) -> None:
    """Bound the raise (None: the default). The setting is the process's (mlx has one buffer
    cache): the last store opened with one decides. A raise already above it is taken back."""
    global _bound
    if nbytes is not None and (not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0):
        raise InvalidInputError(f"buffer_cache_bytes must be a non-negative integer, got {nbytes!r}")
    _bound = nbytes
    if _raised > bound():
        _apply(max(bound(), _before or 0))


def want(nbytes: int) -> int:
    """The limit a restore of `nbytes` asks for: twice it, within the bound (0: no raise)."""
    return min(2 * nbytes, bound())


def keep(nbytes: int) -> None:
    """Let mlx keep freed buffers for a restore of `nbytes` (see the module's docstring).
    Call with mlx imported, never while one of our loads waits for the GIL."""
    goal = want(nbytes)
    if goal <= _raised:
        return
    _apply(goal)


def _apply(goal: int) -> None:
    global _raised, _before
    import mlx.core as mx

    with LOCK:
        previous = mx.set_cache_limit(goal)
        if _before is None:
            _before = previous
        if previous > goal and previous != _raised:  # someone else's higher limit stays
            mx.set_cache_limit(previous)
            goal = previous
        _raised = goal


def held() -> dict[str, int | None] | None:
    """What mlx's buffer cache holds now (`held_bytes`), the limit this module set (`limit_bytes`;
    mlx's own when it never raised it, None if unknown) and its bound; None when this process has
    not imported mlx (then nothing is held)."""
    mx = sys.modules.get("mlx.core")
    if mx is None:
        return None
    return {"held_bytes": int(mx.get_cache_memory()), "limit_bytes": _raised or _before,
            "bound_bytes": bound()}
