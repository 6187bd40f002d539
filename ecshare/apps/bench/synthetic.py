"""Deterministic synthetic entries, so any process can check what it fetched."""

from __future__ import annotations

import hashlib
import re

import numpy as np
import numpy.typing as npt

from ecshare.store import Store

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1 << 10,
    "kib": 1 << 10,
    "m": 1 << 20,
    "mib": 1 << 20,
    "g": 1 << 30,
    "gib": 1 << 30,
}


def parse_size(text: str) -> int:
    """'64KiB', '4m', '1048576' -> bytes."""
    match = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"bad size {text!r}: expected a number with an optional KiB/MiB/GiB unit")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_size(nbytes: int) -> str:
    """65536 -> '64 KiB', 1572864 -> '1.5 MiB': the largest unit that keeps it at least 1."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.4g} {unit}"
    return f"{nbytes} B"


def parse_spec(spec: str) -> list[tuple[int, int]]:
    """'64KiB:4,1MiB:2' -> [(65536, 4), (1048576, 2)]."""
    out = []
    for part in spec.split(","):
        size, _, count = part.partition(":")
        out.append((parse_size(size), int(count or 1)))
    return out


def synthetic_hash(nbytes: int, index: int, tag: str = "syn") -> str:
    return f"{tag}-{nbytes}-{index}"


def synthetic_bytes(mm_hash: str, nbytes: int) -> npt.NDArray[np.uint8]:
    """The content every process agrees belongs to `mm_hash`."""
    seed = int.from_bytes(hashlib.blake2b(mm_hash.encode(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


def fill_synthetic(
    store: Store, spec: str, *, checksum: bool = False
) -> list[dict[str, int | str]]:
    """Put the entries `spec` names into `store`; returns [{"mm_hash", "nbytes"}] in order."""
    entries: list[dict[str, int | str]] = []
    for nbytes, count in parse_spec(spec) if spec else []:
        for i in range(count):
            h = synthetic_hash(nbytes, i)
            store.put(h, synthetic_bytes(h, nbytes), checksum=checksum)
            entries.append({"mm_hash": h, "nbytes": nbytes})
    return entries
