"""The landing: where a consumer's READs of tags land (ecshare/peer/landing.py).

Real stores over real regions; the READs themselves are in test_peer_direct.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ecshare.peer.landing import CHUNK_BYTES, TAGS_PER_READ, TagLanding
from ecshare.store import LANDING_BYTES, Store
from ecshare.store.region import Region

BLOCK = 64 << 10
CHUNKS = LANDING_BYTES // CHUNK_BYTES


@pytest.fixture
def store() -> Iterator[Store]:
    with Region.create(8 << 20, name="ecshare-test-landing") as region:
        yield Store(region, BLOCK, tags=True)


def _chunk_of(store: Store, offset: int, length: int) -> int:
    """Which chunk of the landing `offset`..`offset + length` lies in (all of it)."""
    assert store.landing is not None
    base, nbytes = store.landing
    assert base <= offset and offset + length <= base + nbytes
    chunk = (offset - base) // CHUNK_BYTES
    assert (offset + length - 1 - base) // CHUNK_BYTES == chunk
    return chunk


def test_the_landing_lies_past_the_blocks_and_tags_and_no_entry_takes_it(store: Store) -> None:
    assert store.landing is not None
    base, nbytes = store.landing
    capacity = store.stats().total_blocks
    tag = store.tag_offset(store.put("first", np.zeros(1, np.uint8)))
    assert tag is not None and tag < base  # the tags come first
    assert nbytes == LANDING_BYTES and base + nbytes <= store.region.size
    assert base >= capacity * BLOCK + 8 * capacity
    store.remove("first")
    for i in range(capacity):  # every block taken: none of them overlaps the landing
        entry = store.put(f"e{i}", np.zeros(BLOCK, np.uint8))
        assert all(o + n <= base for o, n in entry.extents)
    # A store without tags has no landing, and no consumer can land tags in it.
    bare = Store(store.region, BLOCK)
    assert bare.landing is None
    with pytest.raises(ValueError, match="no landing"):
        TagLanding(bare)


def test_tags_within_a_page_are_read_as_one_span_into_one_chunk(store: Store) -> None:
    landing = TagLanding(store)
    offsets = [4096 + 8 * 32, 4096, 4096 + 8 * 16]  # three entries of 32 blocks, any order

    read = landing.take(offsets)

    assert read is not None
    [segment] = read.segments
    assert (segment.remote_offset, segment.length) == (4096, 8 * 33)
    chunk = _chunk_of(store, segment.local_offset, segment.length)
    # Each tag lands where its word lies in the span, in the order asked.
    assert [s - segment.local_offset for s in read.slots] == [8 * 32, 0, 8 * 16]
    assert landing.held == 1
    landing.give_back(read)
    assert landing.held == 0
    again = landing.take([0])
    assert again is not None and _chunk_of(store, again.slots[0], 8) == chunk  # reused


def test_tags_far_apart_get_a_descriptor_and_a_slot_each(store: Store) -> None:
    landing = TagLanding(store)
    offsets = [0, 10 * CHUNK_BYTES, 20 * CHUNK_BYTES]

    read = landing.take(offsets)

    assert read is not None
    assert [(s.remote_offset, s.length) for s in read.segments] == [(o, 8) for o in offsets]
    assert [s.local_offset for s in read.segments] == read.slots
    assert len(set(read.slots)) == 3
    assert len({_chunk_of(store, s, 8) for s in read.slots}) == 1
    assert landing.held == 1


def test_the_most_tags_one_read_takes_fit_its_chunk_either_way(store: Store) -> None:
    landing = TagLanding(store)
    close = landing.take([8 * i for i in range(TAGS_PER_READ)])
    spread = landing.take([CHUNK_BYTES * i for i in range(TAGS_PER_READ)])

    assert close is not None and spread is not None
    assert len(close.segments) == 1 and len(spread.segments) == TAGS_PER_READ
    chunks = {_chunk_of(store, s.local_offset, s.length) for s in close.segments}
    chunks |= {_chunk_of(store, s.local_offset, s.length) for s in spread.segments}
    assert len(chunks) == 2  # one each, apart


def test_a_full_landing_answers_none_until_a_chunk_comes_back(store: Store) -> None:
    landing = TagLanding(store)
    reads = [landing.take([8 * i]) for i in range(CHUNKS)]
    assert all(r is not None for r in reads) and landing.held == CHUNKS
    # Every chunk is written by some READ: a new one must not share any.
    assert len({_chunk_of(store, r.slots[0], 8) for r in reads if r is not None}) == CHUNKS

    assert landing.take([0]) is None

    first = reads[0]
    assert first is not None
    landing.give_back(first)
    again = landing.take([64])
    assert again is not None and again.chunk == first.chunk
    with pytest.raises(ValueError, match="twice"):
        landing.give_back(first)  # its chunk is another READ's now


@pytest.mark.parametrize("count", [0, TAGS_PER_READ + 1])
def test_no_tags_or_too_many_for_one_read_is_a_caller_error(store: Store, count: int) -> None:
    with pytest.raises(ValueError, match=f"1 to {TAGS_PER_READ}"):
        TagLanding(store).take([8 * i for i in range(count)])
