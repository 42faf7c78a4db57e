"""Final arrays, allocated once by mlx and (unless small) never written here: the restore writes every byte.

mlx has no `empty`, but its safetensors loader allocates each tensor without writing it and then
asks the file it reads to `readinto` that memory. `_Shell` poses as such a file, holding only a
header: its `readinto` leaves the tensor memory as it is, so `mx.load` hands back arrays whose
memory holds whatever it held (no zeroing, no copy), which the caller writes through numpy views.

mlx keeps a reference to the file object on its I/O thread, and releases it (taking the GIL)
shortly after the load is done; if the interpreter is already finalizing then, the process
aborts. Every shell is therefore tracked, and at exit the interpreter waits (bounded) until mlx
has let go of them all.

mlx's I/O thread also needs the GIL to call `readinto`, so nothing may wait for that load while
holding the GIL: loads run on a stream of their own (no one else's work queues behind them), and
under a lock that `keep_buffers` also takes (`mx.set_cache_limit` waits for every CPU stream
without letting go of the GIL). Calling `mx.set_cache_limit` from another thread while a fetch
runs can still deadlock mlx this way: set it before serving.

mlx evaluates the arrays of a load from a file object one at a time, a round trip to its I/O
thread each (60 to 90 µs here), while zeroing memory that mlx's buffer cache hands back costs
about 1 µs per 12 KiB. So arrays that average under `ZERO_BELOW` bytes are made with `mx.zeros`
instead, all in one evaluation: 8 arrays of 320 KiB (a small model's cache) take 0.18 ms so,
0.7 ms through the shell; 56 of 4 MiB, 30 ms so, 4 ms through the shell.
"""

from __future__ import annotations

import atexit
import json
import math
import struct
import threading
import time
import weakref
from typing import Mapping, Sequence

import mlx.core as mx

from kvstore.restore import buffers
from kvstore.restore.arrays import MX_DTYPES
from kvstore.storage.blobformat import DTYPES

_LIVE: "weakref.WeakSet[_Shell]" = weakref.WeakSet()
_EXIT_WAIT_S = 5.0
ZERO_BELOW = 512 << 10  # average bytes an array under which mx.zeros is cheaper (see above)
_LOCK = buffers.LOCK  # loads and changes of mlx's buffer-cache limit never overlap
_streams = threading.local()  # mlx streams belong to the thread that made them


class _Shell:
    """A read-only 'safetensors file' of the given tensors whose payload is never written."""

    closed = False
    mode = "rb"

    def __init__(self, specs: Mapping[str, tuple[str, Sequence[int]]], itemsize: Mapping[str, int]):
        self._head, self._size = _header(specs, itemsize)
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def readinto(self, buf) -> int:
        pos = self._pos  # read first: mlx may call seek + readinto from several threads
        view = memoryview(buf).cast("B")
        n = len(view)
        if pos < len(self._head):  # the header is real; the tensors' memory is left as it is
            k = min(n, len(self._head) - pos)
            view[:k] = self._head[pos : pos + k]
        self._pos = pos + n
        return n

    def read(self, n: int = -1) -> bytes:
        end = self._size if n is None or n < 0 else min(self._size, self._pos + n)
        out = bytearray(max(0, end - self._pos))
        self.readinto(out)
        return bytes(out)


def _header(specs: Mapping[str, tuple[str, Sequence[int]]], itemsize: Mapping[str, int]) -> tuple[bytes, int]:
    """The safetensors header of these tensors, and the file size it implies. Kept for the
    shapes seen last: a restore of the same plan asks for the same arrays (JSON of 56 tensors is
    about 0.4 ms)."""
    key = tuple((name, tag, tuple(int(d) for d in shape)) for name, (tag, shape) in specs.items())
    with _HEADERS_LOCK:
        hit = _HEADERS.get(key)
    if hit is not None:
        return hit
    header: dict[str, object] = {}
    offset = 0
    for name, tag, shape in key:
        n = itemsize[tag] * math.prod(shape)
        header[name] = {"dtype": tag, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = struct.pack("<Q", len(raw)) + raw
    with _HEADERS_LOCK:
        if len(_HEADERS) >= _HEADERS_MAX:
            _HEADERS.clear()
        _HEADERS[key] = (head, len(head) + offset)
    return head, len(head) + offset


_HEADERS: dict[tuple, tuple[bytes, int]] = {}
_HEADERS_MAX = 64
_HEADERS_LOCK = threading.Lock()


def keep_buffers(nbytes: int) -> None:
    """Make mlx keep freed buffers for reuse by a restore of `nbytes` (`buffers.keep`: twice
    it, within the configured bound, never lowering a limit someone else set)."""
    buffers.keep(nbytes)


def zeroed(specs: Mapping[str, tuple[str, Sequence[int]]]) -> bool:
    """Whether `allocate(specs)` makes its arrays with `mx.zeros` (then they hold zeros), which
    is cheaper for small ones (see the module's docstring)."""
    sizes = [DTYPES[tag].itemsize * math.prod(int(d) for d in shape) for tag, shape in specs.values()]
    sizes = [n for n in sizes if n]  # arrays with no elements are made apart
    return bool(sizes) and sum(sizes) < ZERO_BELOW * len(sizes)


def allocate(specs: Mapping[str, tuple[str, Sequence[int]]]) -> dict[str, mx.array]:
    """Evaluated mlx arrays of these (safetensors dtype tag, shape)s whose memory holds whatever
    it held before: the caller must write every element."""
    itemsize = {tag: np_dtype.itemsize for tag, np_dtype in DTYPES.items()}
    empty = {n: s for n, s in specs.items() if any(int(d) == 0 for d in s[1])}
    real = {n: s for n, s in specs.items() if n not in empty}
    out: dict[str, mx.array] = {}
    stream = getattr(_streams, "load", None)
    if stream is None and real:
        stream = _streams.load = mx.new_stream(mx.cpu)
    if real and zeroed(real):
        out = {name: mx.zeros([int(d) for d in shape], MX_DTYPES[tag], stream=stream)
               for name, (tag, shape) in real.items()}
        mx.eval(list(out.values()))
    elif real:
        shell = _Shell(real, itemsize)
        _LIVE.add(shell)
        with _LOCK:
            out = mx.load(shell, format="safetensors", stream=stream)
            del shell
            mx.eval(list(out.values()))
    for name, (tag, shape) in empty.items():
        out[name] = mx.zeros([int(d) for d in shape], MX_DTYPES[tag])
    return out


@atexit.register
def _wait_for_mlx_to_release_shells() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    while len(_LIVE) and time.monotonic() < deadline:
        time.sleep(0.001)
