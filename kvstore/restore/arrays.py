"""Blob tensors as mlx arrays: the mlx dtype of each safetensors tag, and numpy views of mlx
arrays' memory (bfloat16 travels as its uint16 bits, so every bit stays exact).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvstore.errors import BlobError
from kvstore.storage.blobformat import DTYPES, TAG_OF_NUMPY, header_metadata, parse_header

#: safetensors dtype tag -> mlx dtype
MX_DTYPES: dict[str, mx.Dtype] = {
    "F32": mx.float32, "F16": mx.float16, "BF16": mx.bfloat16,
    "F64": mx.float64 if hasattr(mx, "float64") else mx.float32,
    "I8": mx.int8, "U8": mx.uint8, "I16": mx.int16, "U16": mx.uint16, "I32": mx.int32,
    "U32": mx.uint32, "I64": mx.int64, "U64": mx.uint64, "BOOL": mx.bool_,
}
_TAG_OF_MX = {mxd: tag for tag, mxd in MX_DTYPES.items() if tag != "F64"}


def tag_of(dtype: mx.Dtype | np.dtype) -> str:
    """The safetensors dtype tag of an mlx dtype (or of a numpy one: bfloat16 travels as uint16
    bits and is tagged by whoever knows it is bfloat16)."""
    tag = _TAG_OF_MX.get(dtype) if isinstance(dtype, mx.Dtype) else TAG_OF_NUMPY.get(np.dtype(dtype))
    if tag is None:
        raise BlobError(f"cannot store arrays of dtype {dtype}")
    return tag


def mx_dtype(tag: str) -> mx.Dtype:
    """The mlx dtype of a safetensors dtype tag."""
    return MX_DTYPES[tag]


def host_bits(a: mx.array) -> tuple[mx.array, mx.Dtype | None]:
    """`a` in a dtype numpy can hold, as a lazy zero-copy view, and the dtype to view it back as.

    bfloat16 has no numpy dtype, so it travels as uint16 and is tagged BF16: bits stay exact.
    """
    tag_of(a.dtype)
    if a.dtype == mx.bfloat16:
        return a.view(mx.uint16), mx.bfloat16
    return a, None


def host_array(a: mx.array) -> np.ndarray:
    """An mlx array's memory as numpy, no copy (bfloat16 as its uint16 bits): through its buffer,
    since a `view` op would have to be scheduled and waited for (per tensor, per record).
    A numpy array (a record queued by `insert` holds views of the caller's arrays) is itself."""
    if isinstance(a, np.ndarray):
        return a
    if a.dtype == mx.bfloat16:
        m = memoryview(a)
        if m.c_contiguous:
            return np.frombuffer(m.cast("B"), dtype=np.uint16).reshape(a.shape)
        return np.asarray(a.view(mx.uint16))
    return np.asarray(a)



def decode(buf: bytes | bytearray, where: object = "blob") -> tuple[dict[str, mx.array], dict[str, str]]:
    """Parse safetensors bytes into mlx arrays (one copy per tensor) and the metadata."""
    header, base = parse_header(buf, where)
    arrays: dict[str, mx.array] = {}
    for name, info in header.items():
        tag, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        np_dtype, mx_dtype = DTYPES[tag], MX_DTYPES[tag]
        count = (end - start) // np_dtype.itemsize
        host = np.frombuffer(buf, dtype=np_dtype, count=count, offset=base + start).reshape(shape)
        arr = mx.array(host)
        arrays[name] = arr.view(mx_dtype) if arr.dtype != mx_dtype else arr
    return arrays, header_metadata(buf)

