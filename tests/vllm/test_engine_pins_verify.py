"""An engine never loads an entry a peer wrote after its commit: `EnginePins.pin`, the way
every local hit of the connector goes (a scheduler's probe, a waiting request's hold),
checks the entry against its commit digest and finds such an entry missing.

Any peer that holds this instance's NIXL metadata can WRITE its region
(tests/security/test_reader_write.py shows it over cma and UCX TCP); here the write is
made straight into the region's memory, the same bytes such a WRITE leaves."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ecshare.metrics import read_samples
from ecshare.store import Region, Store
from ecshare.vllm.pins import EnginePins

BLOCK = 64 << 10


@pytest.fixture
def store() -> Iterator[Store]:
    with Region.create(16 * BLOCK, name="ecshare-test-engine-pins") as region:
        yield Store(region, BLOCK)


def _payload(nbytes: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def test_an_entry_written_by_a_peer_after_commit_is_never_pinned_for_a_load(
    store: Store,
) -> None:
    pins = EnginePins(store)
    entry = store.put("item", _payload(2 * BLOCK + 7, seed=1), checksum=True)
    assert pins.pin("item", "probe", 30.0) is not None  # untouched: loads
    off, _ = entry.extents[0]
    store.region.array[off + 1234] ^= 0x5A  # a foreign WRITE into the entry's blocks

    assert pins.pin("item", "probe", 30.0) is None
    assert store.get("item") is None  # dropped: the next request fetches or encodes it
    assert store.stats().foreign_writes == 1
    assert read_samples(stores=[store])["region_foreign_writes"] == {(): 1}


def test_an_entry_committed_without_a_digest_loads_as_it_is(store: Store) -> None:
    """With `checksum: none` nothing records a digest, and nothing is checked (the
    default's documented limit, docs/SECURITY.md)."""
    pins = EnginePins(store)
    entry = store.put("plain", _payload(BLOCK, seed=2))
    store.region.array[entry.extents[0][0]] ^= 0xFF
    assert pins.pin("plain", "probe", 30.0) is not None
    assert store.stats().foreign_writes == 0
