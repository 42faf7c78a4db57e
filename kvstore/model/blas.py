"""Which BLAS mlx computes with on Linux, and the note that says how to get a faster one.

On Linux, `mlx[cpu]` multiplies matrices with the reference BLAS bundled in its wheel, which
makes prefill several times slower than OpenBLAS; the time-to-first-token numbers in
bench/README.md were measured with Debian's OpenBLAS preloaded. Nothing else changes: the same
tokens come out either way.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable

#: A prefill at least this long gets the note: mlx-lm's own prefill step, about where the
#: bundled BLAS starts to cost seconds rather than a fraction of one.
LONG_PREFILL_TOKENS = 2048
#: Debian's and Ubuntu's OpenBLAS, preloaded so that mlx calls it instead of its bundled BLAS.
FIX = ("sudo apt-get install libopenblas0-pthread; "
       "export LD_PRELOAD=/usr/lib/$(uname -m)-linux-gnu/openblas-pthread/libblas.so.3")

_said = False


@functools.cache
def bundled_blas(maps: str = "/proc/self/maps") -> bool:
    """True on Linux when no OpenBLAS is mapped into this process (numpy's own scipy-openblas
    does not count: its symbols have other names, so mlx never calls it)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        lines = Path(maps).read_text().splitlines()
    except OSError:
        return False  # cannot tell: say nothing
    return not any("openblas" in line.lower() and "scipy" not in line.lower() for line in lines)


def note() -> str:
    return ("kvstore: note: mlx is running on the reference BLAS bundled with the mlx-cpu wheel, which "
            "makes prefill several times slower than OpenBLAS; on Debian or Ubuntu: " + FIX)


def long_prefill_note(to_compute: Callable[[], int]) -> str | None:
    """The note, the first time in this process that a prefill of at least `LONG_PREFILL_TOKENS`
    runs on the bundled BLAS; else None. `to_compute` (tokens) is asked only when that matters."""
    global _said
    if _said or not bundled_blas():
        return None
    n = to_compute()
    if n < LONG_PREFILL_TOKENS:
        return None
    _said = True
    return f"{note()} (this prompt computes {n} tokens)"
