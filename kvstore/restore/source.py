"""What the restore reads a record from: an opened record of some tier.

A `Source` has the record's identity, its token ids and its tensors' entries (name -> dtype tag
and shape, `tokens` left out); `read_copies(copies, targets)` copies token ranges of its tensors
into memory the restore owns (checking what it reads), and `array(name)` gives a whole tensor.
The restore never knows which tier a source came from.
"""

from __future__ import annotations

from typing import Protocol, Sequence

import numpy as np

from kvstore.records import RecordId
from kvstore.storage.blobformat import Entry
from kvstore.storage.readplan import Target


class Source(Protocol):
    id: RecordId
    tokens: np.ndarray
    entries: dict[str, Entry]
    in_ram: bool  # held in RAM: the restore may gather its tensors with others'

    def read_copies(self, copies: Sequence, targets: dict[str, Target]) -> None:
        """Each copy `(name, lo, hi, dst)`: tokens [lo, hi) of tensor `name` to tokens
        [dst, dst + hi - lo) of `targets[name].array`. BlobError if what it read is damaged."""

    def array(self, name: str) -> np.ndarray:
        """A whole tensor, checked (bfloat16 as its uint16 bits)."""

    def cold(self) -> bool:
        """Whether reading it will wait for a disk (then the restore reads more records at once)."""

    def close(self) -> None: ...
