"""The one dtype table: the element types an entry may hold, by name, and their sizes.

An entry's meta names its dtype as torch and numpy both spell it ("bfloat16",
"float32"). The size is what lets the store check a shape against the bytes, on
both sides of a transfer, so it is written here once, for every host alike: a name
not in the table (numpy's platform-sized "float128", anything a peer made up) is
refused rather than guessed. Names numpy knows also give the view that `Store.array`
hands out; torch's own types (bfloat16, the float8s) stay flat bytes there.
"""

from __future__ import annotations

import functools
from typing import Any, Final

import numpy as np

__all__ = ["ITEMSIZE", "PLAIN_KINDS", "dtype_itemsize", "numpy_dtype"]

ITEMSIZE: Final[dict[str, int]] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
}
# Only plain numeric kinds may be used to view region bytes. meta can come from
# a peer, and viewing raw bytes as object ("O") would turn them into pointers.
PLAIN_KINDS: Final = frozenset("biufc")


def dtype_itemsize(name: str) -> int | None:
    """The bytes of one element of `name`, or None for a dtype not in the table."""
    return ITEMSIZE.get(name)


@functools.cache
def numpy_dtype(name: str) -> np.dtype[Any] | None:
    """numpy's dtype of that name, where it is one of the table's and numpy has it."""
    if name not in ITEMSIZE:
        return None
    try:
        dtype = np.dtype(name)
    except TypeError:
        return None
    return dtype if dtype.kind in PLAIN_KINDS and dtype.itemsize == ITEMSIZE[name] else None
