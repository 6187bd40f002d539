"""Where the tags of direct reads land (see `ecshare.peer.consumer`, "Direct reads").

A direct read checked by tag READs the entry's tag word back from the producer
once the bytes have landed. The word lands in the consumer's landing: 8-byte
slots in its own region, past its store's tags (`Store.landing`), which no
entry ever takes. A destination thus needs no room past its bytes, and an entry
of whole blocks takes no extra block (nor gives one back before its commit).

One READ brings back the tags of the direct reads of a pass from one producer,
up to `TAGS_PER_READ` of them (a pass with more makes more READs). Each READ
takes one chunk of the landing, a page of slots. Entries written one after
another lie one after another, and so do their tags in the producer's tag
array: where the tags of a READ lie within a page of each other, it is a single
descriptor over their span, into the chunk at the same distances; otherwise it
is one descriptor per tag, into consecutive slots. A few words of other
entries' tags read along with them are never looked at.

A chunk is taken when the READ is posted and goes back once the transport says
the READ has ended. One given up while it may still write (a producer frozen
over TCP) keeps its chunk until then, as a destination stays fenced (the
consumer parks it). With every chunk held, `take` answers None, and those reads
fall back to a granted read. Taking and giving back a chunk is a list's pop and
append: this runs once per fetch, after an idle gap, with every cache cold.

Not thread-safe: the consumer's network lock covers it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ecshare.store import Store
from ecshare.transport.base import Segment

__all__ = ["CHUNK_BYTES", "TAGS_PER_READ", "TagLanding", "TagRead"]

# A chunk of the landing: the slots of one READ of tags, and the widest span of
# tags read with one descriptor.
CHUNK_BYTES = 4096
# The most tags one READ brings back (`take` is asked for at most this many).
TAGS_PER_READ = 256


class TagRead:
    """The landing's side of one READ of tags."""

    __slots__ = ("chunk", "segments", "slots")

    def __init__(self, chunk: int, segments: list[Segment], slots: list[int]) -> None:
        self.chunk = chunk  # which chunk of the landing it writes
        self.segments = segments  # local: the slots; remote: the tag words
        self.slots = slots  # where each tag asked for lands (region byte offsets), in order


class TagLanding:
    """The chunks of one store's landing, handed out to READs of tags."""

    def __init__(self, store: Store) -> None:
        landing = store.landing
        if landing is None:
            raise ValueError("a store without tags has no landing")
        self._store = store
        self._base, nbytes = landing
        self.chunks = nbytes // CHUNK_BYTES
        self._free = list(range(self.chunks - 1, -1, -1))  # popped from the end: 0 first
        self._owners: list[TagRead | None] = [None] * self.chunks

    @property
    def held(self) -> int:
        """Chunks taken by READs of tags not yet ended (or not yet given back)."""
        return self.chunks - len(self._free)

    def take(self, offsets: Sequence[int]) -> TagRead | None:
        """A chunk for the tag words at `offsets` (byte offsets in the producer's
        region, multiples of 8) and the segments that READ them there; None while
        every chunk is held."""
        if not 0 < len(offsets) <= TAGS_PER_READ:
            raise ValueError(f"{len(offsets)} tags to read: 1 to {TAGS_PER_READ} at a time")
        if not self._free:
            return None
        chunk = self._free.pop()
        at = self._base + chunk * CHUNK_BYTES
        lo = min(offsets)
        span = max(offsets) + 8 - lo
        if span <= CHUNK_BYTES:
            read = TagRead(chunk, [Segment(at, lo, span)], [at + o - lo for o in offsets])
        else:
            slots = [at + 8 * i for i in range(len(offsets))]
            read = TagRead(
                chunk, [Segment(s, o, 8) for s, o in zip(slots, offsets, strict=True)], slots
            )
        self._owners[chunk] = read
        return read

    def word(self, slot: int) -> int:
        """The tag that landed in `slot` (read while its READ's chunk is held)."""
        return self._store.word(slot)

    def give_back(self, read: TagRead) -> None:
        """`read` has ended: nothing writes its chunk any more."""
        if self._owners[read.chunk] is not read:
            raise ValueError(f"chunk {read.chunk} of the landing given back twice")
        self._owners[read.chunk] = None
        self._free.append(read.chunk)
