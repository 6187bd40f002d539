"""Where committed entries lie, told to consumers that read directly.

With `read.direct` agreed on a session (config `direct_reads` on both sides),
the producer tells the consumer where each entry it commits lies, in a
`Located` message; the consumer may then READ the entry there with no request
and no grant, and keeps the bytes only if it can tell they were the entry's
(see `ecshare.peer.consumer`, "Direct reads").

Nothing is pinned for a direct read. The consumer learns that the bytes it read
were the entry's from the entry's tag (a word the store keeps for it while its
blocks are its own: `ecshare.store.entries`, "Tags"), or from its digest. Tags
cost nothing here, so every entry's is told; a digest is told where the engine
computed one, and computed here for entries of up to `DIGEST_MAX` bytes, for
which checking it is cheaper than the consumer's second READ of the tag (and
always in a store without tags). A digest is taken under a pin, so that it is
the digest of the bytes the extents held while the entry was READY: one taken
of blocks already reused for another entry would let a consumer keep that
entry's bytes under this entry's name.

The `Locator` is fed on the committing thread (the engine's) by a store
watcher, which only queues the name and wakes the producer's thread; the pin,
the digest and the messages are that thread's work.
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable

from ecshare import protocol as p
from ecshare.store import Entry, EntryState, NotFound, NotReady, Store

# Pins taken while a digest is computed are held under this owner; session
# owners are "session:<id>", so no client can name it.
_OWNER = "ecshare:locate"
_PIN_S = 60.0  # only a bound: the pin goes as soon as the digest is taken
# Names queued and not yet located, at most (the oldest go first past it: a
# producer's thread that falls that far behind tells of the newest).
_QUEUED_MAX = 65536
# Bytes of a Located frame's entries, about, before another frame is started: well
# under the smallest frame limit a peer may set, and `MAX_BATCH_ITEMS` at most.
_FRAME_BUDGET = 256 * 1024
# Entries up to this size are told with a digest, computed here if need be: one
# pass over 1 MiB costs about as much as the consumer's READ of a tag (30 us).
DIGEST_MAX = 1 << 20


class Locator:
    """Queues committed entries (any thread) and makes their `Location`s (one thread)."""

    def __init__(self, store: Store, wake: Callable[[], None]) -> None:
        self._store = store
        self._wake = wake
        self._queued: collections.deque[str] = collections.deque(maxlen=_QUEUED_MAX)
        self._pins = itertools.count(1)
        self._unwatch: Callable[[], None] | None = None
        self.listening = False  # some session reads directly: queue what commits
        self.located = 0
        self.digests = 0  # digests computed here (the engine had not)
        self.gone = 0  # committed, then gone before it could be located

    def start(self) -> None:
        self._unwatch = self._store.watch_commits(self._committed)

    def stop(self) -> None:
        if self._unwatch is not None:
            self._unwatch()
            self._unwatch = None

    @property
    def pending(self) -> bool:
        return bool(self._queued)

    def _committed(self, entry: Entry) -> None:
        """On the committing thread: queue the name and wake the producer's thread once.

        The wake-up goes with the append that makes the queue one long: a drain that
        emptied it saw every name appended before, and the next append wakes again.
        """
        if not self.listening:
            return
        self._queued.append(entry.mm_hash)
        if len(self._queued) == 1:
            self._wake()

    def take(self) -> list[list[p.Location]]:
        """The queued entries still READY, located, in batches for one frame each."""
        names: dict[str, None] = {}
        while True:
            try:
                names[self._queued.popleft()] = None
            except IndexError:
                break
        batches: list[list[p.Location]] = []
        batch: list[p.Location] = []
        size = 0
        for mm_hash in names:
            location = self._locate(mm_hash)
            if location is None:
                continue
            cost = 128 + len(mm_hash) + 16 * len(location.extents) + 8 * len(location.shape)
            if batch and (size + cost > _FRAME_BUDGET or len(batch) >= p.MAX_BATCH_ITEMS):
                batches.append(batch)
                batch, size = [], 0
            batch.append(location)
            size += cost
        if batch:
            batches.append(batch)
        return batches

    def _locate(self, mm_hash: str) -> p.Location | None:
        pin = f"l{next(self._pins)}"
        try:
            self._store.pin(mm_hash, _OWNER, pin, _PIN_S)
        except (NotFound, NotReady):
            self.gone += 1
            return None
        try:
            entry = self._store.pinned_entry(_OWNER, pin)
            if entry is None or entry.state is not EntryState.READY or entry.nbytes <= 0:
                self.gone += 1
                return None
            if len(entry.extents) > p.MAX_EXTENTS_PER_ITEM:
                return None  # too scattered to tell in one Location: granted reads only
            tag_offset = self._store.tag_offset(entry)
            checksum = entry.meta.checksum
            if checksum is None and (tag_offset is None or entry.nbytes <= DIGEST_MAX):
                checksum = self._store.checksum(entry)
                self.digests += 1
            self.located += 1
            return p.Location(
                mm_hash=mm_hash,
                extents=[p.Extent(o, n) for o, n in entry.extents],
                nbytes=entry.nbytes,
                dtype=entry.meta.dtype,
                shape=list(entry.meta.shape),
                checksum=checksum,
                tag=entry.tag if tag_offset is not None else 0,
                tag_offset=tag_offset or 0,
            )
        finally:
            self._store.unpin(_OWNER, pin)
