"""The entry table: which mm_hash owns which blocks, its state, its pins, and LRU eviction.

One lock guards everything. Every method does O(log n) work under it and
never copies payload bytes, so holding it is cheap. Copies happen outside the
lock, in ``Store``. They are safe there because an ALLOCATED entry is touched
only by its writer, and a pinned entry's blocks are never freed.

Life of an entry (``_TRANSITIONS`` is the only place that changes ``state``)::

    ALLOCATED --commit--> READY --evict--> FREED        (unpinned: evicted or removed)
        |   |               \\--doom--> EVICTING --release--> FREED   (removed while pinned)
        |   \\--abort--> FREED
        \\--quarantine--> QUARANTINED --release--> FREED   (a read may still write it)

An EVICTING entry has left the hash index, so the same mm_hash can be stored
again at once. It takes no new pins, and its blocks go back when its last
pin is released, not before. That is what keeps a block from being reused
while a grant on it may still be read.

A QUARANTINED entry is the consumer's side of the same promise: an entry
whose read was given up, but which the data plane may still write. It leaves
the hash index (the item can be fetched again into other blocks) and its
blocks go back only when its writer says the read has ended. A read that never
ends keeps them for good: leaked and counted, never reused.

A reservation (``reserve``) is an ALLOCATED entry with no key yet, outside the
index: its writer learns which item it holds only once the bytes are in, and
``adopt`` then puts it in the index under that key and commits it READY in one
step (its blocks past the item's size go back), or, given a key already live,
frees it and raises. It can be aborted or quarantined like any ALLOCATED entry.

With ``on_free``/``on_allocate`` hooks (the store's debug canary) the table
calls them under its lock with the runs being freed or handed out; with
``on_leave``, with each READY entry that leaves the index (evicted or doomed).

Tags. Each allocation gets a tag, a number no other allocation of this table
gets. With a ``tags`` array (one word per block, in memory peers can read) the
table writes an entry's tag at its first block when it allocates it and zero
there when it frees it, before the blocks can go to anyone else. A peer that
read an entry's bytes and then reads that word back and finds the entry's tag
knows the blocks were not freed before the word was read, so the bytes read
before it were that entry's: tags only ever go from an entry's to zero to
another's, never back (direct reads, ``ecshare.peer.consumer``).
"""

from __future__ import annotations

import enum
import itertools
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec
import numpy as np
import numpy.typing as npt
from sortedcontainers import SortedList

from ecshare.errors import ECShareError, IllegalTransition
from ecshare.store.allocator import BlockAllocator, Run

__all__ = [
    "MAX_BLOCK_SIZE",
    "MIN_BLOCK_SIZE",
    "DigestMismatch",
    "Entry",
    "EntryExists",
    "EntryMeta",
    "EntryState",
    "EntryTable",
    "EntryTooLarge",
    "Hold",
    "IllegalTransition",
    "InvalidMeta",
    "NotFound",
    "NotReady",
    "Pin",
    "PinConflict",
    "StoreError",
    "StoreFull",
    "StoreStats",
]

MIN_BLOCK_SIZE = 4 << 10
MAX_BLOCK_SIZE = 16 << 20


class StoreError(ECShareError):
    """Base of every error the store raises on purpose."""


class NotFound(StoreError):
    """No such entry, or it is being evicted and takes no new readers."""


class NotReady(StoreError):
    """The entry exists but is still being written."""


class EntryExists(StoreError):
    """The mm_hash already has a live (ALLOCATED or READY) entry."""


class StoreFull(StoreError):
    """Not enough free plus evictable blocks; everything else is pinned or being written."""


class InvalidMeta(StoreError, ValueError):
    """A size, dtype and shape that cannot describe an entry: zero bytes, or a
    dtype and shape whose size is not the entry's. From a peer, a grant or an
    offer that disagrees with itself."""


class EntryTooLarge(StoreError, ValueError):
    """More bytes than the whole store holds, even with everything evicted."""


class DigestMismatch(StoreError):
    """Bytes whose xxh3-64 is not the one their writer said they have."""


class PinConflict(StoreError):
    """An (owner, grant_id) that already pins a different entry."""


class EntryState(enum.Enum):
    ALLOCATED = "allocated"
    READY = "ready"
    EVICTING = "evicting"
    QUARANTINED = "quarantined"
    FREED = "freed"

    # Members are singletons and compare by identity. Enum's own __hash__ is
    # Python code, and it showed up in the profile of every transition.
    __hash__ = object.__hash__


_Event = Literal["commit", "abort", "evict", "doom", "quarantine", "release"]

_TRANSITIONS: dict[tuple[EntryState, _Event], EntryState] = {
    (EntryState.ALLOCATED, "commit"): EntryState.READY,
    (EntryState.ALLOCATED, "abort"): EntryState.FREED,
    (EntryState.READY, "evict"): EntryState.FREED,
    (EntryState.READY, "doom"): EntryState.EVICTING,
    (EntryState.EVICTING, "release"): EntryState.FREED,
    (EntryState.ALLOCATED, "quarantine"): EntryState.QUARANTINED,
    (EntryState.QUARANTINED, "release"): EntryState.FREED,
}


class EntryMeta(msgspec.Struct, frozen=True):
    """What a reader needs to rebuild the tensor. dtype is a torch/numpy name, e.g. "bfloat16"."""

    dtype: str = "uint8"
    shape: tuple[int, ...] = ()
    checksum: int | None = None


class Entry(msgspec.Struct, eq=False):
    """One stored item. Callers read it; only the table writes it (under its lock).

    A msgspec Struct, built in C: a fetch makes one on a path that runs cold
    after an idle gap (17 us there as a slotted dataclass, 10 us as a Struct).

    Zero-byte entries are rejected by ``EntryTable.allocate``. They would have
    no blocks and no extents to grant, and NIXL cannot read zero descriptors.
    A producer has nothing to share for an empty tensor, so it should not
    announce one.
    """

    mm_hash: str
    nbytes: int
    runs: tuple[Run, ...]
    meta: EntryMeta
    nblocks: int
    # byte_extents(table block size), computed once, because every copy, view
    # and grant needs them.
    extents: tuple[tuple[int, int], ...]
    state: EntryState = EntryState.ALLOCATED
    pins: int = 0
    last_used: float = 0.0
    tag: int = 0  # this allocation's, unique in its table (see "Tags" above)

    def byte_extents(self, block_size: int) -> list[tuple[int, int]]:
        """(byte offset in the region, byte length) per run; the lengths sum to ``nbytes``."""
        return _byte_extents(self.runs, block_size, self.nbytes)


def _byte_extents(runs: Sequence[Run], block_size: int, nbytes: int) -> list[tuple[int, int]]:
    # The first `nbytes` of the runs, in order.
    extents = []
    left = nbytes
    for r in runs:
        if left <= 0:
            break
        length = min(r.count * block_size, left)
        extents.append((r.start * block_size, length))
        left -= length
    return extents


class Hold(msgspec.Struct, frozen=True):
    """A pin to take under ``owner`` and ``grant_id`` as soon as an entry is READY."""

    owner: str
    grant_id: str
    lease_s: float


class Pin(msgspec.Struct, frozen=True):
    """A reader's hold on an entry's blocks until it unpins or ``expires_at`` passes."""

    owner: str
    grant_id: str
    mm_hash: str
    expires_at: float


@dataclass(eq=False, slots=True)
class _PinRecord:
    owner: str
    grant_id: str
    entry: Entry
    expires_at: float

    def as_pin(self) -> Pin:
        return Pin(self.owner, self.grant_id, self.entry.mm_hash, self.expires_at)


class StoreStats(msgspec.Struct, frozen=True):
    total_blocks: int
    free_blocks: int
    used_blocks: int
    block_size: int
    bytes_used: int
    entries: int
    ready: int
    allocated: int
    evicting: int
    pinned_entries: int
    pins: int
    evictions: int
    reaped_pins: int
    quarantined: int = 0  # entries whose blocks a read may still write
    quarantined_blocks: int = 0
    canary_violations: int = 0  # freed blocks found written (Store's debug canary)
    foreign_writes: int = 0  # READY entries found changed since their commit (Store.verify)
    reserved: int = 0  # ALLOCATED reservations with no key yet (Store.reserve), among allocated
    reserved_blocks: int = 0


class EntryTable:
    """Entries by mm_hash over a block allocator. Thread-safe."""

    def __init__(
        self,
        capacity_blocks: int,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        on_free: Callable[[Sequence[Run]], None] | None = None,
        on_allocate: Callable[[Sequence[Run]], None] | None = None,
        on_leave: Callable[[Entry], None] | None = None,
        tags: npt.NDArray[np.uint64] | None = None,
    ) -> None:
        if block_size & (block_size - 1) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"block_size must be a power of two in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], "
                f"got {block_size}"
            )
        self._alloc = BlockAllocator(capacity_blocks)
        self._block_size = block_size
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}  # ALLOCATED and READY
        self._evicting: set[Entry] = set()
        self._quarantined: set[Entry] = set()
        self._quarantined_blocks = 0
        self._unkeyed: set[Entry] = set()  # ALLOCATED reservations without a key yet
        self._on_free = on_free
        self._on_allocate = on_allocate
        self._on_leave = on_leave
        if tags is not None and len(tags) < capacity_blocks:
            raise ValueError(f"{len(tags)} tag words for {capacity_blocks} blocks")
        self._tags = tags
        # Unique per allocation; a random start, so that tags of another table (a
        # restarted producer's) are unlikely to match either.
        # Below 2**56: a tag fits the wire's signed 64-bit integers.
        self._tag_ids = itertools.count(int.from_bytes(os.urandom(5), "little") << 16 | 1)
        # READY entries without pins, the least recently used first. Only these
        # are evictable, so eviction never has to skip anything.
        self._lru: OrderedDict[str, Entry] = OrderedDict()
        self._lru_blocks = 0
        self._pins: dict[tuple[str, str], _PinRecord] = {}
        self._owner_pins: dict[str, set[str]] = {}
        self._expiry: SortedList = SortedList()  # (expires_at, owner, grant_id)
        self._counts = dict.fromkeys(EntryState, 0)
        self._pinned_entries = 0
        self._bytes_used = 0
        self._evictions = 0
        self._reaped = 0

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def capacity_blocks(self) -> int:
        return self._alloc.total_blocks

    def __len__(self) -> int:
        with self._lock:
            return (
                len(self._entries)
                + len(self._evicting)
                + len(self._quarantined)
                + len(self._unkeyed)
            )

    def __contains__(self, mm_hash: object) -> bool:
        with self._lock:
            return mm_hash in self._entries

    # -- entries -------------------------------------------------------------

    def allocate(self, mm_hash: str, nbytes: int, meta: EntryMeta | None = None) -> Entry:
        """Reserve blocks for ``nbytes``, evicting LRU unpinned READY entries if needed."""
        nblocks = self._blocks_for(mm_hash, nbytes)
        if meta is None:
            meta = EntryMeta(dtype="uint8", shape=(nbytes,))
        with self._lock:
            if mm_hash in self._entries:
                raise EntryExists(f"{mm_hash} is already {self._entries[mm_hash].state.name}")
            entry = self._take_blocks(mm_hash, nbytes, nblocks, meta)
            self._entries[mm_hash] = entry
            return entry

    def reserve(self, nbytes: int) -> Entry:
        """An ALLOCATED entry of ``nbytes`` with no key, outside the index, for a writer
        that learns its key later (``adopt``); evicts like ``allocate``."""
        nblocks = self._blocks_for("a reservation", nbytes)
        with self._lock:
            entry = self._take_blocks("", nbytes, nblocks, EntryMeta(shape=(nbytes,)))
            self._unkeyed.add(entry)
            return entry

    def adopt(
        self,
        entry: Entry,
        mm_hash: str,
        nbytes: int,
        meta: EntryMeta,
        *,
        holds: Sequence[Hold] = (),
    ) -> Entry:
        """A reservation's first ``nbytes`` become the READY entry ``mm_hash``, in one
        step; its blocks past them go back. Called by its writer once every write into
        it has ended: a key already live, or a size it cannot hold, frees the whole
        reservation and raises (EntryExists, InvalidMeta); an entry that is not a
        reservation of this table raises NotFound and changes nothing."""
        for hold in holds:
            _check_lease(hold.lease_s)
        with self._lock:
            if entry not in self._unkeyed:
                raise NotFound(f"no reservation of this table holds {mm_hash!r}'s blocks")
            problem: StoreError | None = None
            if not mm_hash:
                problem = InvalidMeta("a reservation needs a key to be adopted")
            elif not 0 < nbytes <= entry.nbytes:
                problem = InvalidMeta(
                    f"{mm_hash}: {nbytes} bytes do not fit a reservation of {entry.nbytes}"
                )
            elif mm_hash in self._entries:
                problem = EntryExists(f"{mm_hash} is already {self._entries[mm_hash].state.name}")
            if problem is not None:
                self._unkeyed.discard(entry)
                self._fire(entry, "abort")
                raise problem
            keep = -(-nbytes // self._block_size)
            kept: list[Run] = []
            tail: list[Run] = []
            left = keep
            for run in entry.runs:
                if left >= run.count:
                    kept.append(run)
                elif left > 0:
                    kept.append(Run(run.start, left))
                    tail.append(Run(run.start + left, run.count - left))
                else:
                    tail.append(run)
                left -= run.count
            if tail:
                if self._on_free is not None:
                    self._on_free(tail)
                self._alloc.free(tail)
            self._bytes_used += nbytes - entry.nbytes
            self._unkeyed.discard(entry)
            entry.mm_hash = mm_hash
            entry.nbytes = nbytes
            entry.runs = tuple(kept)
            entry.nblocks = keep
            entry.extents = tuple(_byte_extents(kept, self._block_size, nbytes))
            entry.meta = meta
            self._entries[mm_hash] = entry
            self._fire(entry, "commit")
            entry.last_used = self._clock()
            self._lru_add(entry)
            for hold in holds:
                self._pin(mm_hash, hold.owner, hold.grant_id, hold.lease_s)
            return entry

    def abort_reserved(self, entry: Entry) -> None:
        """ALLOCATED -> FREED for a reservation; NotFound, changing nothing, for any
        other entry."""
        with self._lock:
            if entry not in self._unkeyed:
                raise NotFound(f"no reservation of this table is {entry.mm_hash!r}")
            self._unkeyed.discard(entry)
            self._fire(entry, "abort")

    def _blocks_for(self, what: str, nbytes: int) -> int:
        if nbytes <= 0:
            raise InvalidMeta(f"{what}: entries must hold at least one byte, got {nbytes}")
        nblocks = -(-nbytes // self._block_size)
        if nblocks > self._alloc.total_blocks:
            raise EntryTooLarge(
                f"{what}: {nbytes} bytes need {nblocks} blocks, "
                f"capacity is {self._alloc.total_blocks} blocks of {self._block_size}"
            )
        return nblocks

    def _take_blocks(self, mm_hash: str, nbytes: int, nblocks: int, meta: EntryMeta) -> Entry:
        """A new ALLOCATED entry's blocks, evicting if need be (lock held); not indexed."""
        short = nblocks - self._alloc.free_blocks
        if short > 0:
            # We check before evicting anything. A request that cannot
            # succeed must not empty the cache on its way to failing.
            if short > self._lru_blocks:
                raise StoreFull(
                    f"{mm_hash or 'a reservation'}: need {nblocks} blocks of {self._block_size}, "
                    f"{self._alloc.free_blocks} free + {self._lru_blocks} evictable of "
                    f"{self._alloc.total_blocks}; {self._counts[EntryState.ALLOCATED]} "
                    f"being written, {self._pinned_entries} pinned"
                )
            self._evict_lru(short)
        runs = self._alloc.allocate(nblocks)
        if runs is None:  # cannot happen: free blocks were checked above
            raise RuntimeError(f"allocator refused {nblocks} of {self._alloc.free_blocks}")
        if self._on_allocate is not None:
            self._on_allocate(runs)
        extents = tuple(_byte_extents(runs, self._block_size, nbytes))
        entry = Entry(
            mm_hash,
            nbytes,
            tuple(runs),
            meta,
            nblocks,
            extents,
            last_used=self._clock(),
            tag=next(self._tag_ids),
        )
        if self._tags is not None:
            self._tags[runs[0].start] = entry.tag
        self._counts[EntryState.ALLOCATED] += 1
        self._bytes_used += nbytes
        return entry

    def commit(
        self,
        mm_hash: str,
        *,
        expect: Entry | None = None,
        checksum: int | None = None,
        holds: Sequence[Hold] = (),
    ) -> Entry:
        """ALLOCATED -> READY: all bytes are written. ``expect`` guards against a stale Entry.

        ``checksum`` records the digest of the bytes just written, for writers
        that learn it only once the bytes are in place. ``holds`` are pins taken
        in the same step, so that no eviction can come between the entry turning
        READY and its readers holding it.
        """
        for hold in holds:
            _check_lease(hold.lease_s)
        with self._lock:
            entry = self._live(mm_hash, expect)
            self._fire(entry, "commit")
            if checksum is not None:
                entry.meta = msgspec.structs.replace(entry.meta, checksum=checksum)
            entry.last_used = self._clock()
            self._lru_add(entry)
            for hold in holds:
                self._pin(mm_hash, hold.owner, hold.grant_id, hold.lease_s)
            return entry

    def abort(self, mm_hash: str, *, expect: Entry | None = None) -> None:
        """ALLOCATED -> FREED: the writer gives up; the blocks go back at once."""
        with self._lock:
            if expect is not None and expect in self._unkeyed:
                self._unkeyed.discard(expect)
                self._fire(expect, "abort")
                return
            entry = self._live(mm_hash, expect)
            self._fire(entry, "abort")
            del self._entries[mm_hash]

    def quarantine(self, mm_hash: str, *, expect: Entry) -> None:
        """ALLOCATED -> QUARANTINED: the writer gives up, but a read may still write.

        The entry leaves the index at once; its blocks stay held until
        ``release_quarantined``.
        """
        with self._lock:
            if expect in self._unkeyed:
                self._unkeyed.discard(expect)
                entry = expect
            else:
                entry = self._live(mm_hash, expect)
                del self._entries[mm_hash]
            self._fire(entry, "quarantine")
            self._quarantined.add(entry)
            self._quarantined_blocks += entry.nblocks

    def release_quarantined(self, entry: Entry) -> None:
        """QUARANTINED -> FREED: nothing can write the entry's blocks any more."""
        with self._lock:
            if entry not in self._quarantined:
                raise IllegalTransition(f"{entry.mm_hash}: not quarantined ({entry.state.name})")
            self._quarantined.discard(entry)
            self._quarantined_blocks -= entry.nblocks
            self._fire(entry, "release")

    def get(self, mm_hash: str) -> Entry | None:
        """The ALLOCATED or READY entry for ``mm_hash`` (EVICTING ones are gone for readers)."""
        with self._lock:
            return self._entries.get(mm_hash)

    def get_ready(self, mm_hash: str) -> Entry:
        """The READY entry for ``mm_hash``, marked as just used; NotFound/NotReady otherwise."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None:
                raise NotFound(f"{mm_hash} is not stored")
            if entry.state is not EntryState.READY:
                raise NotReady(f"{mm_hash} is {entry.state.name}")
            entry.last_used = self._clock()
            if mm_hash in self._lru:
                self._lru.move_to_end(mm_hash)
            return entry

    def touch(self, mm_hash: str) -> bool:
        """Mark a READY entry as just used (LRU). False if there is no READY entry."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None or entry.state is not EntryState.READY:
                return False
            entry.last_used = self._clock()
            if mm_hash in self._lru:
                self._lru.move_to_end(mm_hash)
            return True

    def remove(self, mm_hash: str, *, expect: Entry | None = None) -> bool:
        """Drop a READY entry now, or when its last pin goes. False if absent (or, with
        ``expect``, if the entry under ``mm_hash`` is another)."""
        with self._lock:
            entry = self._entries.get(mm_hash)
            if entry is None or (expect is not None and entry is not expect):
                return False
            if entry.state is EntryState.ALLOCATED:
                # Freeing the blocks now would let a new entry share them while
                # the writer is still copying. Only the writer may abort().
                raise NotReady(f"{mm_hash} is being written; its writer must abort() it")
            del self._entries[mm_hash]
            if entry.pins:
                self._fire(entry, "doom")
                self._evicting.add(entry)
            else:
                self._lru_discard(entry)
                self._fire(entry, "evict")
            self._left(entry)
            return True

    def evict_bytes(self, nbytes: int) -> int:
        """Evict LRU unpinned READY entries until ``nbytes`` of blocks are freed; returns bytes."""
        with self._lock:
            want = -(-nbytes // self._block_size)
            return self._evict_lru(min(want, self._lru_blocks)) * self._block_size

    # -- pins ----------------------------------------------------------------

    def pin(self, mm_hash: str, owner: str, grant_id: str, lease_s: float) -> Pin:
        """Hold a READY entry's blocks for a reader until unpin or lease expiry.

        Idempotent per (owner, grant_id). A duplicate request for the same
        entry renews the one pin that exists and never adds a second one.
        """
        _check_lease(lease_s)
        with self._lock:
            return self._pin(mm_hash, owner, grant_id, lease_s)

    def _pin(self, mm_hash: str, owner: str, grant_id: str, lease_s: float) -> Pin:
        """`pin` with the lock held."""
        now = self._clock()
        rec = self._pins.get((owner, grant_id))
        if rec is not None and rec.expires_at <= now:
            self._release(rec, reaped=True)  # it is dead, whoever notices first
            rec = None
        if rec is not None:
            if rec.entry.mm_hash != mm_hash:
                raise PinConflict(
                    f"({owner}, {grant_id}) already pins {rec.entry.mm_hash}, not {mm_hash}"
                )
            self._set_expiry(rec, now + lease_s)
            return rec.as_pin()
        entry = self._entries.get(mm_hash)
        if entry is None:
            raise NotFound(f"{mm_hash} is not stored (or is being evicted)")
        if entry.state is not EntryState.READY:
            raise NotReady(f"{mm_hash} is {entry.state.name}, only READY entries are pinned")
        rec = _PinRecord(owner, grant_id, entry, now + lease_s)
        self._pins[(owner, grant_id)] = rec
        self._owner_pins.setdefault(owner, set()).add(grant_id)
        self._expiry.add((rec.expires_at, owner, grant_id))
        if entry.pins == 0:
            self._lru_discard(entry)
            self._pinned_entries += 1
        entry.pins += 1
        entry.last_used = now
        return rec.as_pin()

    def renew(self, owner: str, grant_id: str, lease_s: float) -> bool:
        """Extend a live pin to now + lease_s. False if unknown, released, or already expired."""
        _check_lease(lease_s)
        with self._lock:
            rec = self._pins.get((owner, grant_id))
            if rec is None:
                return False
            now = self._clock()
            if rec.expires_at <= now:
                self._release(rec, reaped=True)
                return False
            self._set_expiry(rec, now + lease_s)
            return True

    def pinned_entry(self, owner: str, grant_id: str) -> Entry | None:
        """The entry that (owner, grant_id) pins. Its blocks stay valid while the pin lives."""
        with self._lock:
            rec = self._pins.get((owner, grant_id))
            return None if rec is None else rec.entry

    def unpin(self, owner: str, grant_id: str) -> bool:
        """Release a pin. True exactly once per pin."""
        with self._lock:
            rec = self._pins.get((owner, grant_id))
            if rec is None:
                return False
            self._release(rec, reaped=False)
            return True

    def unpin_owner(self, owner: str) -> int:
        """Release every pin of ``owner`` (its session ended); returns how many."""
        with self._lock:
            grant_ids = list(self._owner_pins.get(owner, ()))
            for grant_id in grant_ids:
                self._release(self._pins[(owner, grant_id)], reaped=False)
            return len(grant_ids)

    def reap_expired(
        self, now: float | None = None, *, owner_prefix: str = ""
    ) -> list[tuple[str, str]]:
        """Release every pin whose lease has run out; returns their (owner, grant_id).

        With ``owner_prefix``, only pins whose owner starts with it: each holder of
        pins (a producer's sessions, an engine's loads) reaps its own.
        """
        with self._lock:
            if now is None:
                now = self._clock()
            expired = self._expiry.irange(maximum=(now, chr(0x10FFFF), chr(0x10FFFF)))
            due = [(o, g) for _, o, g in expired if o.startswith(owner_prefix)]
            for owner, grant_id in due:
                self._release(self._pins[(owner, grant_id)], reaped=True)
            return due

    def next_expiry(self) -> float | None:
        """When the earliest lease runs out (clock time), for the reaper's sleep."""
        with self._lock:
            return float(self._expiry[0][0]) if self._expiry else None

    # -- accounting ----------------------------------------------------------

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(
                total_blocks=self._alloc.total_blocks,
                free_blocks=self._alloc.free_blocks,
                used_blocks=self._alloc.used_blocks,
                block_size=self._block_size,
                bytes_used=self._bytes_used,
                entries=len(self._entries)
                + len(self._evicting)
                + len(self._quarantined)
                + len(self._unkeyed),
                ready=self._counts[EntryState.READY],
                allocated=self._counts[EntryState.ALLOCATED],
                evicting=self._counts[EntryState.EVICTING],
                pinned_entries=self._pinned_entries,
                pins=len(self._pins),
                evictions=self._evictions,
                reaped_pins=self._reaped,
                quarantined=len(self._quarantined),
                quarantined_blocks=self._quarantined_blocks,
                reserved=len(self._unkeyed),
                reserved_blocks=sum(e.nblocks for e in self._unkeyed),
            )

    def check_invariants(self) -> None:
        """Raise AssertionError if any bookkeeping disagrees (tests, fault harness). O(blocks)."""
        with self._lock:
            self._alloc.check_invariants()
            live = [
                *self._entries.values(),
                *self._evicting,
                *self._quarantined,
                *self._unkeyed,
            ]
            owner_of: list[str | None] = [None] * self._alloc.total_blocks
            used = 0
            for entry in live:
                if entry.state is EntryState.FREED:
                    raise AssertionError(f"{entry.mm_hash}: FREED entry still indexed")
                wanted = -(-entry.nbytes // self._block_size)
                if entry.nblocks != wanted or entry.nblocks != sum(r.count for r in entry.runs):
                    raise AssertionError(f"{entry.mm_hash}: {entry.nblocks} blocks for {entry}")
                if list(entry.extents) != entry.byte_extents(self._block_size):
                    raise AssertionError(f"{entry.mm_hash}: stale extents {entry.extents}")
                for run in entry.runs:
                    for b in range(run.start, run.end):
                        if owner_of[b] is not None:
                            raise AssertionError(
                                f"block {b} in both {owner_of[b]} and {entry.mm_hash}"
                            )
                        owner_of[b] = entry.mm_hash
                    used += run.count
            for run in self._alloc.free_runs():
                for b in range(run.start, run.end):
                    if owner_of[b] is not None:
                        raise AssertionError(f"block {b} is free but held by {owner_of[b]}")
            if used != self._alloc.used_blocks or used + self._alloc.free_blocks != len(owner_of):
                raise AssertionError(
                    f"entries hold {used} blocks, allocator: used {self._alloc.used_blocks} "
                    f"free {self._alloc.free_blocks} total {self._alloc.total_blocks}"
                )
            if self._bytes_used != sum(e.nbytes for e in live):
                raise AssertionError("bytes_used disagrees with the entries")
            for state in EntryState:
                n = sum(1 for e in live if e.state is state)
                if n != self._counts[state] and state is not EntryState.FREED:
                    raise AssertionError(f"{n} {state.name} entries, counter says {self._counts}")
            if any(e.state is not EntryState.EVICTING or e.pins <= 0 for e in self._evicting):
                raise AssertionError("evicting set holds an entry that is not pinned+EVICTING")
            if any(e.state is not EntryState.QUARANTINED or e.pins for e in self._quarantined):
                raise AssertionError("quarantined set holds an entry that is not QUARANTINED")
            if any(e.state is not EntryState.ALLOCATED or e.mm_hash for e in self._unkeyed):
                raise AssertionError("a reservation without a key is not ALLOCATED")
            if self._quarantined_blocks != sum(e.nblocks for e in self._quarantined):
                raise AssertionError("quarantined block count disagrees")
            self._check_pins(live)

    # -- internals (lock held) -----------------------------------------------

    def _check_pins(self, live: list[Entry]) -> None:
        per_entry: dict[int, int] = {}
        for (owner, grant_id), rec in self._pins.items():
            if (rec.owner, rec.grant_id) != (owner, grant_id):
                raise AssertionError(f"pin index key {(owner, grant_id)} names {rec}")
            if rec.entry.state not in (EntryState.READY, EntryState.EVICTING):
                raise AssertionError(f"pin {owner}/{grant_id} on a {rec.entry.state.name} entry")
            per_entry[id(rec.entry)] = per_entry.get(id(rec.entry), 0) + 1
        for entry in live:
            if entry.pins != per_entry.pop(id(entry), 0):
                raise AssertionError(f"{entry.mm_hash}: pins={entry.pins}, pin records disagree")
        if per_entry:
            raise AssertionError("pins on entries that are no longer in the table")
        if sorted(self._expiry) != sorted((r.expires_at, *k) for k, r in self._pins.items()):
            raise AssertionError("expiry index disagrees with the pins")
        by_owner = {(o, g) for o, gs in self._owner_pins.items() for g in gs}
        if by_owner != set(self._pins) or any(not gs for gs in self._owner_pins.values()):
            raise AssertionError("owner index disagrees with the pins")
        if self._pinned_entries != sum(1 for e in live if e.pins):
            raise AssertionError("pinned entry counter disagrees")
        lru = [e for e in live if e.state is EntryState.READY and not e.pins]
        if {id(e) for e in lru} != {id(e) for e in self._lru.values()}:
            raise AssertionError("LRU does not hold exactly the unpinned READY entries")
        if self._lru_blocks != sum(e.nblocks for e in lru):
            raise AssertionError("evictable block count disagrees")

    def _fire(self, entry: Entry, event: _Event) -> None:
        new = _TRANSITIONS.get((entry.state, event))
        if new is None:
            raise IllegalTransition(f"{entry.mm_hash}: cannot {event} a {entry.state.name} entry")
        self._counts[entry.state] -= 1
        self._counts[new] += 1
        entry.state = new
        if new is EntryState.FREED:
            # The only place blocks go back: an entry is FREED exactly when its
            # blocks may be reused.
            if self._tags is not None:
                self._tags[entry.runs[0].start] = 0  # before anyone may have the blocks
            if self._on_free is not None:
                self._on_free(entry.runs)
            self._alloc.free(entry.runs)
            self._bytes_used -= entry.nbytes

    def _left(self, entry: Entry) -> None:
        # A READY entry left the index: whoever mirrors the index hears it under the lock,
        # so never after a newer entry of the same mm_hash was committed.
        if self._on_leave is not None:
            self._on_leave(entry)

    def _live(self, mm_hash: str, expect: Entry | None) -> Entry:
        entry = self._entries.get(mm_hash)
        if entry is None or (expect is not None and entry is not expect):
            raise NotFound(f"{mm_hash} is not stored (or that entry was already aborted)")
        return entry

    def _lru_add(self, entry: Entry) -> None:
        self._lru[entry.mm_hash] = entry
        self._lru_blocks += entry.nblocks

    def _lru_discard(self, entry: Entry) -> None:
        # By identity: a doomed entry may share its mm_hash with a newer one.
        if self._lru.get(entry.mm_hash) is entry:
            del self._lru[entry.mm_hash]
            self._lru_blocks -= entry.nblocks

    def _evict_lru(self, nblocks: int) -> int:
        freed = 0
        while freed < nblocks and self._lru:
            mm_hash, victim = self._lru.popitem(last=False)
            self._lru_blocks -= victim.nblocks
            del self._entries[mm_hash]
            self._fire(victim, "evict")
            self._left(victim)
            self._evictions += 1
            freed += victim.nblocks
        return freed

    def _set_expiry(self, rec: _PinRecord, expires_at: float) -> None:
        self._expiry.remove((rec.expires_at, rec.owner, rec.grant_id))
        rec.expires_at = expires_at
        self._expiry.add((expires_at, rec.owner, rec.grant_id))

    def _release(self, rec: _PinRecord, *, reaped: bool) -> None:
        del self._pins[(rec.owner, rec.grant_id)]
        grants = self._owner_pins[rec.owner]
        grants.discard(rec.grant_id)
        if not grants:
            del self._owner_pins[rec.owner]
        self._expiry.remove((rec.expires_at, rec.owner, rec.grant_id))
        if reaped:
            self._reaped += 1
        entry = rec.entry
        entry.pins -= 1
        if entry.pins:
            return
        self._pinned_entries -= 1
        if entry.state is EntryState.EVICTING:
            self._evicting.discard(entry)
            self._fire(entry, "release")
        else:
            # Being read counts as use, so it goes back in as most recently used.
            entry.last_used = self._clock()
            self._lru_add(entry)


def _check_lease(lease_s: float) -> None:
    if not (lease_s > 0 and math.isfinite(lease_s)):
        raise ValueError(f"lease_s must be a positive finite number of seconds, got {lease_s}")
