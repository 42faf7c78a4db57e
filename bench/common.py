"""Shared helpers for the benchmarks: cache shapes, timing, page-cache control, raw I/O, results.

Nothing here is timed by tests; every number the benchmarks print comes from these helpers, so the
baselines (raw reads, cold reads) and kvstore are measured the same way in the same run.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import KVCache

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
# Run as `python bench/x.py` from a checkout: measure that checkout's kvstore, unless PYTHONPATH says
# which one (e.g. another checkout's, to compare restore code with the same benchmark).
if str(REPO) not in sys.path and not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(REPO))

OPENBLAS_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libblas.so.3",
)


# -- cache shapes ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """The KV-cache shape of a real model: what the restore benchmarks store and fetch."""

    name: str
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * np.dtype("u2").itemsize

    def model(self) -> "ShapeModel":
        return ShapeModel(self.layers, self.kv_heads, self.head_dim)


SHAPES = {
    "qwen3-0.6b": Shape("qwen3-0.6b", layers=28, kv_heads=8, head_dim=128),
    "llama-3-8b": Shape("llama-3-8b", layers=32, kv_heads=8, head_dim=128),
}


class ShapeModel(nn.Module):
    """Stands in for a model where only the cache shape matters (I/O benchmarks).

    `make_prompt_cache` makes one `KVCache` per entry of `layers`; `Store.bind` needs nothing
    else once a fingerprint is given. Calling it appends zero K/V of its shape to each layer (what
    a forward pass does to the cache), so the store can trace the shapes records must have.
    """

    def __init__(self, layers: int, kv_heads: int = 8, head_dim: int = 128):
        super().__init__()
        self.layers = [nn.Module() for _ in range(layers)]
        self.kv_heads, self.head_dim = kv_heads, head_dim

    def __call__(self, inputs: mx.array, cache: list | None = None) -> mx.array:
        batch, tokens = inputs.shape
        kv = mx.zeros((batch, self.kv_heads, tokens, self.head_dim), mx.bfloat16)
        for layer in cache or []:
            layer.update_and_fetch(kv, kv)
        return mx.zeros((batch, tokens, 1))


def random_cache(shape: Shape, tokens: int, seed: int = 0) -> list[KVCache]:
    """A list of mlx-lm `KVCache` holding `tokens` tokens of random bfloat16 K/V in `shape`.

    The values are finite random bits (|x| in about [0.008, 4), random sign), cut from one random
    pool at a different offset per array: fast to make, and no two arrays are equal.
    """
    rng = np.random.default_rng(seed)
    dims = (1, shape.kv_heads, tokens, shape.head_dim)
    n = int(np.prod(dims))
    pool = rng.integers(0x3C00, 0x4080, size=2 * n, dtype=np.uint16)
    pool |= rng.integers(0, 2, size=2 * n, dtype=np.uint16) << 15
    cache = []
    for i in range(shape.layers):
        layer = KVCache()
        k0, v0 = (i * 7919) % n, (i * 104729 + n // 2) % n
        keys = mx.array(pool[k0 : k0 + n].reshape(dims)).view(mx.bfloat16)
        values = mx.array(pool[v0 : v0 + n].reshape(dims)).view(mx.bfloat16)
        layer.update_and_fetch(keys, values)
        mx.eval(layer.keys, layer.values)
        cache.append(layer)
    return cache


def random_tokens(n: int, seed: int = 0, vocab: int = 150_000) -> np.ndarray:
    return np.random.default_rng(seed + 10_000).integers(0, vocab, size=n, dtype=np.int64).astype(np.int32)


def kv_arrays(cache: list) -> list[mx.array]:
    """The keys and values every `KVCache` layer holds (up to its offset)."""
    out = []
    for c in cache:
        if c.keys is not None:
            out += [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]
    return out


def cache_nbytes(cache: list) -> int:
    return sum(int(a.nbytes) for a in kv_arrays(cache))


def eval_cache(cache: list) -> list:
    """Evaluate every array a cache holds (mlx is lazy: a load is only done once evaluated)."""
    from mlx.utils import tree_flatten

    mx.eval([v for _, v in tree_flatten([c.state for c in cache]) if isinstance(v, mx.array)])
    return cache


def trimmed_copy(cache: list[KVCache], n: int) -> list[KVCache]:
    """Fresh `KVCache`s holding the first `n` tokens of `cache` (copied, so they own their data)."""
    out = []
    for c in cache:
        layer = KVCache()
        if n:
            k, v = kv_arrays([c])
            layer.update_and_fetch(mx.array(k[..., :n, :]), mx.array(v[..., :n, :]))
        out.append(layer)
    eval_cache(out)
    return out


# -- timing ---------------------------------------------------------------------------------

def measure(fn: Callable[[], object], reps: int, *, warmup: int = 1,
            before: Callable[[], object] | None = None) -> list[float]:
    """Wall-clock seconds of `fn` over `reps` runs (after `warmup` unrecorded ones).

    `before` runs ahead of every run, untimed (for example, to evict the page cache).
    """
    for _ in range(warmup):
        if before:
            before()
        fn()
    samples = []
    for _ in range(reps):
        if before:
            before()
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return samples


def summary(samples: list[float]) -> dict:
    s = sorted(samples)
    return {"median": statistics.median(s), "min": s[0], "max": s[-1], "n": len(s),
            "p50": percentile(s, 50), "p99": percentile(s, 99)}


def percentile(samples: Iterable[float], q: float) -> float:
    s = sorted(samples)
    if not s:
        return float("nan")
    return float(np.percentile(np.asarray(s), q, method="higher"))


def gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")


# -- page cache -----------------------------------------------------------------------------

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte))


def resident_fraction(paths: Iterable[Path]) -> float:
    """Fraction of the pages of `paths` that are in the page cache (mincore over a mapping)."""
    page = mmap.PAGESIZE
    total = resident = 0
    for p in paths:
        size = os.path.getsize(p)
        if size == 0:
            continue
        with open(p, "rb") as f:
            # A private (copy-on-write) mapping is writable for ctypes, and touching nothing
            # leaves mincore reporting the page cache's pages.
            m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
        try:
            n = (size + page - 1) // page
            vec = (ctypes.c_ubyte * n)()
            anchor = ctypes.c_char.from_buffer(m)
            if _libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            resident += sum(b & 1 for b in bytes(vec))
            total += n
            del anchor
        finally:
            m.close()
    return resident / total if total else 1.0


def evict(paths: Iterable[Path]) -> None:
    """Drop `paths` from the page cache with posix_fadvise(DONTNEED) (clean pages only)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_cold(paths: list[Path]) -> str:
    """Evict `paths` from the page cache and say how: 'fadvise', 'drop_caches' or '' (failed)."""
    evict(paths)
    if resident_fraction(paths) <= 0.01:
        return "fadvise"
    for p in paths:  # dirty pages cannot be dropped: write them back, then ask again
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
        finally:
            os.close(fd)
    evict(paths)
    if resident_fraction(paths) <= 0.01:
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:  # 1: the page cache only
            f.write("1\n")
    except OSError:
        return ""
    return "drop_caches" if resident_fraction(paths) <= 0.01 else ""


def warm(paths: Iterable[Path]) -> None:
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(8 << 20):
                pass


# -- raw I/O baselines ----------------------------------------------------------------------

def raw_read(paths: list[Path], buf: bytearray | memoryview) -> int:
    """Read every file whole into one preallocated buffer, in order: the warm-cache baseline."""
    view = memoryview(buf)
    pos = 0
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            got = os.readv(fd, [view[pos : pos + size]])
        finally:
            os.close(fd)
        pos += got
    return pos


def aligned_buffer(nbytes: int, *, prefault: bool = True) -> mmap.mmap:
    """An anonymous, page-aligned buffer of `nbytes` (mmap'd memory starts on a page).

    `prefault` writes one byte a page so later reads into it take no page faults: the strict
    physical limit a restore into fresh memory is compared against.
    """
    buf = mmap.mmap(-1, max(nbytes, 1))
    if prefault:
        np.frombuffer(buf, dtype=np.uint8)[:: mmap.PAGESIZE] = 0
    return buf


def read_files(paths: list[Path], buf, offsets: list[int] | None = None) -> int:
    """`preadv` every file whole into `buf` at `offsets` (default: back to back). Plain buffered I/O."""
    view = memoryview(buf).cast("B")
    pos, total = 0, 0
    for i, p in enumerate(paths):
        at = offsets[i] if offsets is not None else pos
        fd = os.open(p, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            done = 0
            while done < size:  # a read may return short: keep going until the file is in
                got = os.preadv(fd, [view[at + done : at + size]], done)
                if got <= 0:
                    raise OSError(f"{p}: file ended at {done} of {size} bytes")
                done += got
        finally:
            os.close(fd)
        pos = at + size
        total += size
    view.release()
    return total


def file_offsets(paths: list[Path]) -> tuple[list[int], int]:
    """Back-to-back offsets of `paths` in one buffer, and the buffer size they need."""
    offsets, pos = [], 0
    for p in paths:
        offsets.append(pos)
        pos += os.path.getsize(p)
    return offsets, pos


def split_by_bytes(paths: list[Path], parts: int) -> list[list[int]]:
    """Indexes of `paths` in `parts` groups of about equal bytes (largest first, greedy)."""
    groups: list[list[int]] = [[] for _ in range(parts)]
    sizes = [0] * parts
    for i in sorted(range(len(paths)), key=lambda i: -os.path.getsize(paths[i])):
        g = sizes.index(min(sizes))
        groups[g].append(i)
        sizes[g] += os.path.getsize(paths[i])
    return [sorted(g) for g in groups if g]


def cpu_seconds() -> float:
    """CPU time (user + system) of this process so far, every thread included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def page_faults() -> tuple[int, int]:
    """(minor, major) page faults of this process so far, every thread included."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_minflt, r.ru_majflt


# -- environment ----------------------------------------------------------------------------

def openblas_path() -> str | None:
    for p in OPENBLAS_CANDIDATES:
        if os.path.exists(p):
            return p
    return None


def preload_openblas(tag: str) -> None:
    """Start this script again with Debian's OpenBLAS preloaded, when it is installed and not loaded:
    prefill of a real-size model on mlx's bundled BLAS is many times slower (Qwen3-0.6B's shape, 512
    tokens: 49 s against more than 4 minutes on a busy 2-core VM)."""
    blas = openblas_path()
    if blas is None or "openblas" in blas_in_use():
        return
    log(f"[{tag}] starting again with LD_PRELOAD={blas} (Debian's OpenBLAS: mlx's own BLAS prefills many "
        "times slower)")
    env = dict(os.environ, LD_PRELOAD=" ".join(filter(None, [blas, os.environ.get("LD_PRELOAD")])))
    os.execve(sys.executable, [sys.executable, *sys.argv], env)


def blas_in_use() -> str:
    """Which BLAS this process has loaded: Debian's OpenBLAS via LD_PRELOAD, or mlx's bundled one."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "unknown"
    # numpy maps its own scipy-openblas in every process: look for Debian's library only.
    if "openblas-pthread/libblas" in maps or "openblas-openmp/libblas" in maps:
        return "OpenBLAS (Debian libopenblas0-pthread, LD_PRELOAD)"
    if platform.system() == "Darwin":
        return "Accelerate"
    return "reference BLAS bundled with the mlx-cpu wheel"


def log_machine(tag: str) -> None:
    """Say where the numbers that follow come from: the CPU, its cores, the BLAS and the load."""
    m = machine()
    log(f"[{tag}] {m['cpu']}, {m['cores']} cores, BLAS: {blas_in_use()}; load average {m['load_average_1m']}")


def machine() -> dict:
    import mlx_lm

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    fs = ""
    try:
        out = subprocess.run(["df", "-T", str(scratch_root())], capture_output=True, text=True).stdout
        fs = " ".join(out.splitlines()[-1].split()[:2])
    except Exception:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {
        "cpu": cpu, "cores": os.cpu_count(), "memory_gb": round(mem / 1e9, 1),
        "os": f"{platform.system()} {platform.release()}", "python": platform.python_version(),
        "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "numpy": np.__version__,
        "filesystem": fs, "load_average_1m": round(load, 2),
    }


def scratch_root() -> Path:
    """Where benchmark stores live: $KVSTORE_BENCH_DIR, else the system temp folder."""
    root = Path(os.environ.get("KVSTORE_BENCH_DIR") or tempfile.gettempdir()) / "kvstore-bench"
    root.mkdir(parents=True, exist_ok=True)
    return root


def scratch_dir(name: str) -> Path:
    """A fresh folder for one benchmark; folders left by benchmark processes that died go first."""
    for old in scratch_root().iterdir():
        pid = old.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(old, ignore_errors=True)
    d = scratch_root() / f"{name}-{os.getpid()}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    return d


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def blob_files(store_path: Path) -> list[Path]:
    """Every finished file under the store's blob folder (not temporary or hidden files such as locks)."""
    return sorted(p for p in (store_path / "blobs").rglob("*") if p.is_file() and not p.name.startswith("."))


def write_result(name: str, data: dict, out: Path | None = None) -> Path:
    """Write `data` (with the time) to results/<name>.json, or to `out` when given."""
    out = out or RESULTS / f"{name}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".json.tmp")
    data = dict(data, written_utc=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))  # when, for readers of it
    tmp.write_text(json.dumps(data, indent=2, default=_jsonable) + "\n")
    os.replace(tmp, out)
    return out


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"cannot write {type(o).__name__} to JSON")


def positive_int(text: str) -> int:
    """An argparse type for a count (tokens, rows, rounds): a whole number of at least 1."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{text} is less than 1: it counts something, at least one")
    return n


def non_negative_float(text: str) -> float:
    """An argparse type for seconds or gigabytes: a number of at least 0."""
    try:
        x = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not x >= 0:
        raise argparse.ArgumentTypeError(f"{text} is less than 0")
    return x


def log(*parts) -> None:
    print(*parts, flush=True, file=sys.stderr)
