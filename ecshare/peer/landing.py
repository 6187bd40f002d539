"""Where the tags of direct reads land (see `ecshare.peer.consumer`, "Direct reads").

A direct read checked by tag READs the entry's tag word back from the producer
once the bytes have landed. The word lands in the consumer's landing: 8-byte
slots in its own region, past its store's tags (`Store.landing`), which no
entry ever takes. A destination thus needs no room past its bytes, and an entry
of whole blocks takes no extra block (nor gives one back before its commit).

One READ brings back the tags of the direct reads of a pass from one producer,
up to `TAGS_PER_READ` of them (a pass with more makes more READs, so that no
one READ needs more of the landing than a share of it). Entries written one
after another lie one after another, and so do their tags in the producer's tag
array: where the tags lie close together, the READ is a single descriptor over
their span, into as many consecutive slots; otherwise it is one descriptor per
tag. A few words of other entries' tags read along with them are never looked
at.

Slots are taken when the READ is posted and go back once the transport says it
has ended. A READ given up while it may still write (a producer frozen over TCP)
keeps its slots until then, as a destination stays fenced (the consumer parks
it). With every slot held, `take` answers None, and those reads fall back to a
granted read.

Not thread-safe: the consumer's network lock covers it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ecshare.store import BlockAllocator, Run, Store
from ecshare.transport.base import Segment

__all__ = ["SPAN_MAX_BYTES", "SPAN_WORDS_PER_TAG", "TAGS_PER_READ", "TagLanding", "TagRead"]

# A batch's tags are read as one span when it is at most a page, or at most this
# many words per tag (the rest of it: tags of entries between theirs) and at most
# a quarter of the landing.
SPAN_MAX_BYTES = 4096
SPAN_WORDS_PER_TAG = 8
# The most tags one READ brings back (`take` is asked for at most this many).
TAGS_PER_READ = 256


@dataclass(frozen=True)
class TagRead:
    """The landing's side of one READ of tags."""

    segments: list[Segment]  # local: the slots; remote: the tag words
    slots: list[int]  # where each tag asked for lands (region byte offsets), in order
    runs: list[Run]  # the slots taken, in slot units


class TagLanding:
    """The slots of one store's landing, handed out to READs of tags."""

    def __init__(self, store: Store) -> None:
        landing = store.landing
        if landing is None:
            raise ValueError("a store without tags has no landing")
        self._store = store
        self._base, nbytes = landing
        self._slots = BlockAllocator(nbytes // 8)
        self._span_max = nbytes // 4

    @property
    def held(self) -> int:
        """Slots taken by READs not yet ended (or not yet given back)."""
        return self._slots.used_blocks

    def take(self, offsets: Sequence[int]) -> TagRead | None:
        """Slots for the tag words at `offsets` (byte offsets in the producer's region,
        multiples of 8) and the segments that READ them there; None while too few
        slots are free."""
        if not 0 < len(offsets) <= TAGS_PER_READ:
            raise ValueError(f"{len(offsets)} tags to read: 1 to {TAGS_PER_READ} at a time")
        lo = min(offsets)
        span = max(offsets) + 8 - lo
        if span <= SPAN_MAX_BYTES or (
            span <= SPAN_WORDS_PER_TAG * 8 * len(offsets) and span <= self._span_max
        ):
            runs = self._slots.allocate(span // 8)
            if runs is not None and len(runs) == 1:
                at = self._base + 8 * runs[0].start
                return TagRead([Segment(at, lo, span)], [at + o - lo for o in offsets], runs)
            if runs is not None:  # no free stretch that long: a slot per tag
                self._slots.free(runs)
        runs = self._slots.allocate(len(offsets))
        if runs is None:
            return None
        slots = [self._base + 8 * i for run in runs for i in range(run.start, run.end)]
        segments = [Segment(s, o, 8) for s, o in zip(slots, offsets, strict=True)]
        return TagRead(segments, slots, runs)

    def word(self, slot: int) -> int:
        """The tag that landed in `slot` (read while its READ's slots are held)."""
        return self._store.word(slot)

    def give_back(self, read: TagRead) -> None:
        """`read` has ended: nothing writes its slots any more."""
        self._slots.free(read.runs)
