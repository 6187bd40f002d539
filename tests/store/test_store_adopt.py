"""Store.reserve / Store.adopt: blocks written before their key is known (a push into a
consumer's standing credit) become an entry only with the bytes their writer vouched
for; every bad input frees the reservation with a clear error."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import xxhash

from ecshare.store import (
    DigestMismatch,
    EntryExists,
    EntryMeta,
    EntryState,
    Hold,
    InvalidMeta,
    NotFound,
    Region,
    Store,
    StoreFull,
)

BLOCK = 64 << 10


@pytest.fixture
def region() -> Iterator[Region]:
    with Region.create(16 * BLOCK, name="ecshare-test-adopt") as r:
        yield r


@pytest.fixture
def store(region: Region) -> Store:
    return Store(region, BLOCK, canary=True)


def _write(store: Store, entry_extents: tuple[tuple[int, int], ...], data: np.ndarray) -> None:
    pos = 0
    for off, n in entry_extents:
        take = min(n, data.nbytes - pos)
        if take <= 0:
            break
        store.region.array[off : off + take] = data[pos : pos + take]
        pos += take


def _free(store: Store) -> int:
    return store.stats().free_blocks


def test_reservation_is_never_found_by_key_and_holds_its_blocks(store: Store) -> None:
    credit = store.reserve(8 * BLOCK)
    assert credit.state is EntryState.ALLOCATED and credit.mm_hash == ""
    assert store.get("") is None
    assert _free(store) == 8
    store.check_invariants()


def test_adopted_reservation_is_ready_with_its_writers_bytes_and_gives_back_the_rest(
    store: Store,
) -> None:
    credit = store.reserve(8 * BLOCK)
    data = np.random.default_rng(1).integers(0, 256, 3 * BLOCK + 100, dtype=np.uint8)
    _write(store, credit.extents, data)
    meta = EntryMeta("uint8", (data.nbytes,), xxhash.xxh3_64_intdigest(data.tobytes()))
    hold = Hold("reader", "g1", 10.0)
    entry = store.adopt(credit, "h1", data.nbytes, meta, holds=[hold])
    assert entry.state is EntryState.READY and entry.mm_hash == "h1"
    assert store.get("h1") is entry and entry.pins == 1
    assert np.array_equal(store.read("h1"), data)
    assert entry.nblocks == 4 and _free(store) == 16 - 4
    store.check_invariants()
    # The blocks given back are reusable (and untouched since: the canary holds).
    store.put("other", np.zeros(12 * BLOCK, dtype=np.uint8))
    assert store.stats().canary_violations == 0
    store.check_invariants()


def test_adopt_under_a_key_already_present_frees_the_reservation(store: Store) -> None:
    store.put("h1", np.ones(BLOCK, dtype=np.uint8))
    credit = store.reserve(4 * BLOCK)
    with pytest.raises(EntryExists, match="h1"):
        store.adopt(credit, "h1", BLOCK, EntryMeta("uint8", (BLOCK,)))
    assert credit.state is EntryState.FREED and _free(store) == 15
    assert np.array_equal(store.read("h1"), np.ones(BLOCK, dtype=np.uint8))
    store.check_invariants()


@pytest.mark.parametrize(
    ("nbytes", "meta"),
    [
        (5 * BLOCK, EntryMeta("uint8", (5 * BLOCK,))),  # more than the reservation holds
        (0, EntryMeta("uint8", (0,))),  # nothing
        (BLOCK, EntryMeta("float32", (BLOCK,))),  # meta of another size
        (BLOCK, EntryMeta("object", (BLOCK,))),  # a dtype that is not plain bytes
    ],
)
def test_adopt_of_a_wrong_size_or_meta_frees_the_reservation(
    store: Store, nbytes: int, meta: EntryMeta
) -> None:
    credit = store.reserve(4 * BLOCK)
    with pytest.raises(InvalidMeta):
        store.adopt(credit, "h1", nbytes, meta)
    assert credit.state is EntryState.FREED and store.get("h1") is None
    assert _free(store) == 16
    store.check_invariants()


def test_adopt_of_bytes_without_the_said_digest_makes_no_entry(store: Store) -> None:
    credit = store.reserve(4 * BLOCK)
    data = np.full(BLOCK, 7, dtype=np.uint8)
    _write(store, credit.extents, data)
    wrong = xxhash.xxh3_64_intdigest(np.full(BLOCK, 8, dtype=np.uint8).tobytes())
    with pytest.raises(DigestMismatch):
        store.adopt(credit, "h1", BLOCK, EntryMeta("uint8", (BLOCK,), wrong))
    assert store.get("h1") is None and credit.state is EntryState.FREED and _free(store) == 16
    store.check_invariants()


def test_adopt_of_an_entry_that_is_no_reservation_changes_nothing(store: Store) -> None:
    keyed = store.allocate("h0", BLOCK)
    with pytest.raises(NotFound):
        store.adopt(keyed, "h1", BLOCK, EntryMeta("uint8", (BLOCK,)))
    with pytest.raises(NotFound):  # even with a meta that is wrong too
        store.adopt(keyed, "h1", 3, EntryMeta("uint8", (BLOCK,)))
    assert store.get("h0") is keyed and keyed.state is EntryState.ALLOCATED
    credit = store.reserve(BLOCK)
    store.adopt(credit, "h1", BLOCK, EntryMeta("uint8", (BLOCK,)))
    with pytest.raises(NotFound):  # adopted once: a replay finds no reservation
        store.adopt(credit, "h2", BLOCK, EntryMeta("uint8", (BLOCK,)))
    assert store.get("h2") is None and store.get("h1") is credit
    store.check_invariants()


def test_quarantined_reservation_keeps_its_blocks_until_released(store: Store) -> None:
    credit = store.reserve(16 * BLOCK)
    store.quarantine(credit)
    with pytest.raises(StoreFull):
        store.allocate("h1", BLOCK)
    with pytest.raises(NotFound):
        store.adopt(credit, "h1", BLOCK, EntryMeta("uint8", (BLOCK,)))
    assert store.stats().quarantined_blocks == 16
    store.release_quarantined(credit)
    assert _free(store) == 16
    store.check_invariants()


def test_aborted_reservation_gives_its_blocks_back(store: Store) -> None:
    credit = store.reserve(16 * BLOCK)
    store.abort(credit)
    assert credit.state is EntryState.FREED and _free(store) == 16
    store.put("h1", np.zeros(16 * BLOCK, dtype=np.uint8))
    assert store.stats().canary_violations == 0
    store.check_invariants()


def test_reservation_evicts_lru_like_any_allocation(store: Store) -> None:
    store.put("old", np.zeros(12 * BLOCK, dtype=np.uint8))
    credit = store.reserve(8 * BLOCK)
    assert store.get("old") is None and credit.nblocks == 8
    store.check_invariants()
