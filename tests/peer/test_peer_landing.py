"""The landing: where a consumer's READs of tags land (ecshare/peer/landing.py).

Real stores over real regions; the READs themselves are in test_peer_direct.py.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from ecshare.peer.landing import SPAN_MAX_BYTES, TAGS_PER_READ, TagLanding
from ecshare.store import LANDING_BYTES, Store
from ecshare.store.region import Region

BLOCK = 64 << 10
SLOTS = LANDING_BYTES // 8


@pytest.fixture
def store() -> Iterator[Store]:
    with Region.create(8 << 20, name="ecshare-test-landing") as region:
        yield Store(region, BLOCK, tags=True)


def _inside_landing(store: Store, offset: int, length: int) -> bool:
    assert store.landing is not None
    base, nbytes = store.landing
    return base <= offset and offset + length <= base + nbytes


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


def test_tags_that_lie_close_are_read_as_one_span_into_consecutive_slots(store: Store) -> None:
    landing = TagLanding(store)
    offsets = [4096 + 8 * 32, 4096, 4096 + 8 * 16]  # three entries of 32 blocks... in any order

    read = landing.take(offsets)

    assert read is not None
    [segment] = read.segments
    assert (segment.remote_offset, segment.length) == (4096, 8 * 33)
    assert _inside_landing(store, segment.local_offset, segment.length)
    # Each tag lands where its word lies in the span, in the order asked.
    assert [s - segment.local_offset for s in read.slots] == [8 * 32, 0, 8 * 16]
    assert landing.held == 33
    landing.give_back(read)
    assert landing.held == 0


def test_tags_far_apart_get_a_descriptor_and_a_slot_each(store: Store) -> None:
    landing = TagLanding(store)
    offsets = [0, 10 * SPAN_MAX_BYTES, 20 * SPAN_MAX_BYTES]

    read = landing.take(offsets)

    assert read is not None
    assert [(s.remote_offset, s.length) for s in read.segments] == [(o, 8) for o in offsets]
    assert [s.local_offset for s in read.segments] == read.slots
    assert len(set(read.slots)) == 3
    assert all(_inside_landing(store, s, 8) for s in read.slots)
    assert landing.held == 3


def test_a_full_landing_answers_none_until_slots_come_back(store: Store) -> None:
    landing = TagLanding(store)
    reads = [landing.take([8 * i]) for i in range(SLOTS)]
    assert all(r is not None for r in reads) and landing.held == SLOTS
    # Every slot is written by some READ: a new one must not share any.
    assert len({r.slots[0] for r in reads if r is not None}) == SLOTS

    assert landing.take([0]) is None

    first = reads[0]
    assert first is not None
    landing.give_back(first)
    again = landing.take([64])
    assert again is not None and again.slots == first.slots


def test_a_span_with_no_free_stretch_that_long_falls_back_to_a_slot_per_tag(store: Store) -> None:
    landing = TagLanding(store)
    held = [landing.take([8 * i]) for i in range(SLOTS)]
    for r in held[::2]:  # every other slot free: no two in a row
        assert r is not None
        landing.give_back(r)
    free_before = SLOTS - landing.held

    read = landing.take([0, 8, 16])

    assert read is not None
    assert [(s.remote_offset, s.length) for s in read.segments] == [(0, 8), (8, 8), (16, 8)]
    assert SLOTS - landing.held == free_before - 3  # the span's failed try gave its slots back


def test_a_span_never_takes_more_than_a_quarter_of_the_landing(store: Store) -> None:
    landing = TagLanding(store)
    # 8 words a tag at most, but 256 tags so spread would take the whole landing.
    offsets = [8 * 8 * i for i in range(TAGS_PER_READ)]

    read = landing.take(offsets)

    assert read is not None and len(read.segments) == TAGS_PER_READ  # a slot each
    assert landing.held == TAGS_PER_READ


@pytest.mark.parametrize("count", [0, TAGS_PER_READ + 1])
def test_no_tags_or_too_many_for_one_read_is_a_caller_error(store: Store, count: int) -> None:
    with pytest.raises(ValueError, match=f"1 to {TAGS_PER_READ}"):
        TagLanding(store).take([8 * i for i in range(count)])
