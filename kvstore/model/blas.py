"""Which BLAS mlx computes with on Linux, the note that says how to get a faster one, and what
computed an exact-mode store's records.

On Linux, `mlx[cpu]` multiplies matrices with the reference BLAS bundled in its wheel, which
makes prefill several times slower than OpenBLAS; the time-to-first-token numbers in
bench/README.md were measured with Debian's OpenBLAS preloaded. The two BLAS sum in other orders:
their logits differ in the last bits (about 1e-6 in float32), which can flip a near-tied token.
So an exact-mode store (docs/exact.md) is exact only under the BLAS and mlx that computed its
records: the store keeps which (`computed_with`), and a process that computes otherwise is told
once, and `verify --exact` names it as the likely cause of a mismatch.
"""

from __future__ import annotations

import functools
import logging
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
_told: set[bytes] = set()  # namespaces whose other BLAS this process was told of
log = logging.getLogger("kvstore")


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


@functools.cache
def blas_name(maps: str = "/proc/self/maps") -> str:
    """The BLAS mlx multiplies with here, in a few words (the OpenBLAS library's file name)."""
    if sys.platform == "darwin":
        return "Accelerate"
    if not sys.platform.startswith("linux"):
        return "unknown BLAS"
    if bundled_blas(maps):
        return "the mlx-cpu wheel's bundled BLAS"
    try:
        paths = [line.split()[-1] for line in Path(maps).read_text().splitlines() if len(line.split()) >= 6]
    except OSError:
        return "unknown BLAS"
    names = [Path(p).name for p in paths if "openblas" in p.lower() and "scipy" not in p.lower()]
    best = next((n for n in names if "openblas" in n.lower()), names[0] if names else "")
    return f"OpenBLAS ({best})" if best else "OpenBLAS"


def compute() -> str:
    """What this process computes with: mlx's version, its default device and the BLAS."""
    import mlx.core as mx

    return f"mlx {mx.__version__} on {mx.default_device()}, {blas_name()}"


def check_exact_store(index, ns: bytes, *, record: bool) -> str | None:
    """An exact-mode namespace is bound: keep what this process computes with among those that
    computed its records (`record`: the store is written), and warn once per namespace when its
    records were computed otherwise. Returns that warning, or None."""
    mine = compute()
    try:
        known = index.computed_with(ns)
        if record and mine not in known:
            index.add_computed_with(ns, mine)
    except Exception as e:  # only a note: a busy or read-only index does not stop a bind
        log.debug("kvstore: cannot read or keep what computed the records (%s)", e)
        return None
    others = [k for k in known if k != mine]
    if not others or ns in _told:
        return None
    _told.add(ns)
    text = (f"kvstore: this exact-mode store's records were computed with {'; '.join(others)}, and this process "
            f"computes with {mine}: restored runs may differ from cold ones in their last bits (kvstore verify "
            "--exact says); compute with the same BLAS and mlx, or warm the store again")
    log.warning(text)
    return text


def mismatch_cause(index, ns: bytes) -> str:
    """What likely explains a mismatch found by `verify --exact`: the records were computed with
    another BLAS or mlx than this process computes with ("" when not, or not known)."""
    try:
        others = [k for k in index.computed_with(ns) if k != compute()]
    except Exception:
        return ""
    return (f"the store's records were computed with {'; '.join(others)}, this process computes with "
            f"{compute()}: that is the likely cause") if others else ""


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
