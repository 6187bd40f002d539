"""Store: the region's bytes plus the entry table's bookkeeping.

``Store`` is the one face of the store package: allocate, write, commit, abort,
quarantine, pin and unpin all go through it. The entry table behind it keeps
the state machine and its invariants (``ecshare/store/entries.py``).

Payload copies run outside the table's lock. The state machine makes that
safe: an ALLOCATED entry's blocks belong to its writer alone, and a pinned
entry's blocks are never freed. Every copy is ``np.copyto`` between uint8
views, which numpy turns into a plain memcpy.

The debug canary (``canary=True``, the ``store_canary`` setting) turns a write
after free into a counted, logged violation: every freed block is filled with
a pattern, and every block handed out again is checked for it first. Both run
under the table's lock and touch every byte of the blocks, so it is for tests
and the fault harness, not for serving.

Foreign writes. Every peer that holds this node's NIXL metadata can write its
region, not only read it (tests/security/test_reader_write.py). An entry's
digest, where one was recorded at commit (``put(checksum=True)``, ``commit(checksum=)``),
lives in its meta, out of their reach: ``verify`` finds any change since the
commit, counts it (``foreign_writes``) and drops the entry.
"""

from __future__ import annotations

import functools
import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import msgspec
import numpy as np
import numpy.typing as npt
import xxhash

from ecshare.store.allocator import Run
from ecshare.store.dtypes import PLAIN_KINDS, dtype_itemsize, numpy_dtype
from ecshare.store.entries import (
    DigestMismatch,
    Entry,
    EntryMeta,
    EntryState,
    EntryTable,
    Hold,
    InvalidMeta,
    NotFound,
    Pin,
    StoreError,
    StoreStats,
    _byte_extents,
)
from ecshare.store.region import Region

__all__ = ["Store"]

log = logging.getLogger(__name__)
# Blocks are multiples of 4 KiB, so every block is a whole number of these words.
_CANARY_WORD = np.uint64(0xA5C35A3CDEADBEEF)

Bytes = npt.NDArray[np.uint8]


# Past the tags of a store with tags: 8-byte slots where a consumer's direct reads
# land the tags they read back from producers (`ecshare.peer.landing`).
LANDING_BYTES = 64 * 1024


def tag_bytes(capacity_blocks: int) -> int:
    """Room for the tags of `capacity_blocks` blocks, whole pages."""
    return -(-8 * capacity_blocks // 4096) * 4096


def tail_bytes(capacity_blocks: int) -> int:
    """What a store with tags keeps past `capacity_blocks` blocks: their tags, and
    the landing (`LANDING_BYTES`)."""
    return tag_bytes(capacity_blocks) + LANDING_BYTES


class Store:
    """Entries in a region: put, write/commit, zero-copy views, reads and checksums."""

    def __init__(
        self,
        region: Region,
        block_size: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        canary: bool = False,
        tags: bool = False,
    ) -> None:
        """With `tags`, the region's tail past the blocks holds one word per block for
        the entry table's tags (see `entries`, "Tags"), and then the landing: the
        slots where tags read from other stores land (`landing`; `tail_bytes` says
        how much the two take)."""
        capacity = region.size // block_size
        if tags:  # the most blocks that fit beside their tail; a few steps from the estimate
            capacity = max(0, region.size - LANDING_BYTES) // (block_size + 8)
            while (capacity + 1) * block_size + tail_bytes(capacity + 1) <= region.size:
                capacity += 1
            while capacity and capacity * block_size + tail_bytes(capacity) > region.size:
                capacity -= 1
        if capacity < 1:
            raise ValueError(f"region of {region.size} bytes holds no block of {block_size}")
        self._region = region
        self._block_size = block_size
        self._canary_violations = 0
        self._foreign_writes = 0
        self._count_lock = threading.Lock()
        self._canary_words: np.ndarray | None = None
        if canary:
            self._canary_words = region.array[: capacity * block_size].view(np.uint64)
            self._canary_words.fill(_CANARY_WORD)
        self._tag_base: int | None = None
        self._landing: tuple[int, int] | None = None
        tag_words = None
        if tags:
            self._tag_base = capacity * block_size
            self._landing = (self._tag_base + tag_bytes(capacity), LANDING_BYTES)
            tag_words = region.array[self._tag_base : self._tag_base + 8 * capacity].view(np.uint64)
            tag_words.fill(0)
        self._table = EntryTable(
            capacity,
            block_size,
            clock=clock,
            on_free=self._fill_canary if canary else None,
            on_allocate=self._check_canary if canary else None,
            on_leave=self._left,
            tags=tag_words,
        )
        # Told of each entry that turns READY, on the committing thread (`watch_commits`).
        self._watchers: tuple[Callable[[Entry], None], ...] = ()
        # Told of each READY entry that leaves the index, under the table's lock.
        self._leave_watchers: tuple[Callable[[Entry], None], ...] = ()

    @property
    def region(self) -> Region:
        return self._region

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def landing(self) -> tuple[int, int] | None:
        """(byte offset, bytes) in the region of the landing, in a store with tags:
        bytes no entry ever takes, where a consumer lands the tags it reads back."""
        return self._landing

    def get(self, mm_hash: str) -> Entry | None:
        return self._table.get(mm_hash)

    def remove(self, mm_hash: str) -> bool:
        return self._table.remove(mm_hash)

    def stats(self) -> StoreStats:
        stats = self._table.stats()
        if self._canary_violations or self._foreign_writes:
            return msgspec.structs.replace(
                stats,
                canary_violations=self._canary_violations,
                foreign_writes=self._foreign_writes,
            )
        return stats

    @property
    def canary(self) -> bool:
        return self._canary_words is not None

    # -- writing -------------------------------------------------------------

    def put(
        self, mm_hash: str, data: object, meta: EntryMeta | None = None, *, checksum: bool = False
    ) -> Entry:
        """Store ``data`` under ``mm_hash`` and make it READY.

        ``data`` can be any buffer, numpy array or torch-like tensor. A device
        tensor is copied to host first. If ``meta`` is None, dtype and shape
        come from ``data``. With ``checksum`` the xxh3-64 of the bytes is
        recorded in ``meta.checksum``.
        """
        src, inferred = _as_bytes(data)
        meta = inferred if meta is None else _check_meta(meta, src.nbytes, mm_hash)
        if checksum:
            meta = msgspec.structs.replace(meta, checksum=xxhash.xxh3_64_intdigest(src.data))
        entry = self._table.allocate(mm_hash, src.nbytes, meta)
        try:
            self._copy_in(entry, src)
        except BaseException:
            self._table.abort(mm_hash, expect=entry)
            raise
        return self._committed(self._table.commit(mm_hash, expect=entry))

    def allocate(self, mm_hash: str, nbytes: int, meta: EntryMeta | None = None) -> Entry:
        """Reserve an entry to fill with ``write`` (or straight through ``views``), then
        commit."""
        if meta is not None:
            _check_meta(meta, nbytes, mm_hash)
        return self._table.allocate(mm_hash, nbytes, meta)

    def reserve(self, nbytes: int) -> Entry:
        """Reserve ``nbytes`` of blocks for a writer that learns only later which item it
        writes (a push into a consumer's standing credit): an ALLOCATED entry with no
        key, never found by ``get``, to ``adopt``, ``abort`` or ``quarantine``."""
        return self._table.reserve(nbytes)

    def adopt(
        self,
        entry: Entry,
        mm_hash: str,
        nbytes: int,
        meta: EntryMeta,
        *,
        holds: Sequence[Hold] = (),
    ) -> Entry:
        """Commit a reservation's first ``nbytes`` as the READY entry ``mm_hash``, once
        every write into it has ended; the rest of its blocks go back.

        Never an entry with bytes other than its writer's word: a ``meta.checksum``
        is checked against the bytes first. Bad input frees the whole reservation and
        raises: a size that does not fit it or its meta (InvalidMeta), bytes that do
        not have that checksum (DigestMismatch), a key already live (EntryExists). An
        entry that is not a reservation of this store raises NotFound, and nothing
        changes."""
        try:
            if not 0 < nbytes <= entry.nbytes:
                raise InvalidMeta(
                    f"{mm_hash}: {nbytes} bytes do not fit a reservation of {entry.nbytes}"
                )
            _check_meta(meta, nbytes, mm_hash)
            if meta.checksum is not None:
                digest = xxhash.xxh3_64()
                for off, n in _byte_extents(entry.runs, self._block_size, nbytes):
                    digest.update(self._region.view(off, n))
                if digest.intdigest() != meta.checksum:
                    raise DigestMismatch(f"{mm_hash}: the bytes written are not the item's")
        except StoreError:
            self._table.abort_reserved(entry)  # NotFound, changing nothing, if not one
            raise
        return self._committed(self._table.adopt(entry, mm_hash, nbytes, meta, holds=holds))

    def tag_offset(self, entry: Entry) -> int | None:
        """Byte offset in the region of the word holding `entry`'s tag while its blocks
        are its own (see `entries`, "Tags"); None in a store without tags."""
        if self._tag_base is None:
            return None
        return self._tag_base + 8 * entry.runs[0].start

    def word(self, offset: int) -> int:
        """The 8-byte little-endian word at byte `offset` of the region."""
        return int.from_bytes(self._region.array[offset : offset + 8].tobytes(), "little")

    def write(self, entry: Entry, data: object) -> None:
        """Copy ``data`` (exactly ``entry.nbytes`` bytes) into an ALLOCATED entry."""
        if entry.state is not EntryState.ALLOCATED:
            raise StoreError(f"{entry.mm_hash} is {entry.state.name}; only ALLOCATED is writable")
        src, _ = _as_bytes(data)
        if src.nbytes != entry.nbytes:
            raise InvalidMeta(
                f"{entry.mm_hash}: entry holds {entry.nbytes} bytes, got {src.nbytes}"
            )
        self._copy_in(entry, src)

    def commit(
        self, entry: Entry, *, checksum: int | None = None, holds: Sequence[Hold] = ()
    ) -> Entry:
        """ALLOCATED -> READY. ``checksum`` records the digest of the bytes just
        written; ``holds`` are pins taken in the same step, so that no eviction
        comes between the entry turning READY and its readers holding it."""
        return self._committed(
            self._table.commit(entry.mm_hash, expect=entry, checksum=checksum, holds=holds)
        )

    def watch_commits(self, watcher: Callable[[Entry], None]) -> Callable[[], None]:
        """Call `watcher(entry)` for each entry that turns READY from now on, on the
        thread that commits it, after the commit; returns the call that stops it.

        A watcher must be quick and must not raise: it runs in the writer's step (an
        engine's, say). It must not take the entry's blocks as still holding its
        bytes later on without a pin: the entry may be evicted right after.
        """
        self._watchers = (*self._watchers, watcher)

        def stop() -> None:
            self._watchers = tuple(w for w in self._watchers if w is not watcher)

        return stop

    def watch_removals(self, watcher: Callable[[Entry], None]) -> Callable[[], None]:
        """Call `watcher(entry)` for each READY entry that leaves the index (evicted, or
        removed while pinned) from now on; returns the call that stops it.

        It runs under the entry table's lock, so it sees removals in the order they
        happen and before any later commit of the same mm_hash: it must be quick, must
        not raise and must not call back into this store.
        """
        self._leave_watchers = (*self._leave_watchers, watcher)

        def stop() -> None:
            self._leave_watchers = tuple(w for w in self._leave_watchers if w is not watcher)

        return stop

    def _left(self, entry: Entry) -> None:
        for watcher in self._leave_watchers:
            try:
                watcher(entry)
            except Exception:  # the removal stands whatever a watcher does
                log.exception("removal watcher failed for %s", entry.mm_hash)

    def _committed(self, entry: Entry) -> Entry:
        for watcher in self._watchers:
            try:
                watcher(entry)
            except Exception:  # the commit stands whatever a watcher does
                log.exception("commit watcher failed for %s", entry.mm_hash)
        return entry

    def abort(self, entry: Entry) -> None:
        """ALLOCATED -> FREED: the writer gives up; the blocks go back at once."""
        self._table.abort(entry.mm_hash, expect=entry)

    def quarantine(self, entry: Entry) -> None:
        """ALLOCATED -> QUARANTINED: the writer gives up, but a read may still write
        the blocks; they stay held until ``release_quarantined``."""
        self._table.quarantine(entry.mm_hash, expect=entry)

    def release_quarantined(self, entry: Entry) -> None:
        """QUARANTINED -> FREED: nothing can write the entry's blocks any more."""
        self._table.release_quarantined(entry)

    # -- pins and leases -----------------------------------------------------

    def pin(self, mm_hash: str, owner: str, grant_id: str, lease_s: float) -> Pin:
        """Hold a READY entry's blocks until unpin or lease expiry; idempotent per
        (owner, grant_id)."""
        return self._table.pin(mm_hash, owner, grant_id, lease_s)

    def renew(self, owner: str, grant_id: str, lease_s: float) -> bool:
        """Extend a live pin to now + lease_s. False if unknown, released or expired."""
        return self._table.renew(owner, grant_id, lease_s)

    def pinned_entry(self, owner: str, grant_id: str) -> Entry | None:
        """The entry that (owner, grant_id) pins; its blocks stay valid while the pin lives."""
        return self._table.pinned_entry(owner, grant_id)

    def unpin(self, owner: str, grant_id: str) -> bool:
        """Release a pin. True exactly once per pin."""
        return self._table.unpin(owner, grant_id)

    def unpin_owner(self, owner: str) -> int:
        """Release every pin of ``owner`` (its session ended); returns how many."""
        return self._table.unpin_owner(owner)

    def reap_expired(
        self, now: float | None = None, *, owner_prefix: str = ""
    ) -> list[tuple[str, str]]:
        """Release the pins whose lease has run out (of owners starting with
        ``owner_prefix``); returns their (owner, grant_id)."""
        return self._table.reap_expired(now, owner_prefix=owner_prefix)

    def next_expiry(self) -> float | None:
        """When the earliest lease runs out (clock time), for a reaper's sleep."""
        return self._table.next_expiry()

    def touch(self, mm_hash: str) -> bool:
        """Mark a READY entry as just used (LRU). False if there is no READY entry."""
        return self._table.touch(mm_hash)

    def evict_bytes(self, nbytes: int) -> int:
        """Evict LRU unpinned READY entries until ``nbytes`` of blocks are freed."""
        return self._table.evict_bytes(nbytes)

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping disagrees (tests, fault harness)."""
        self._table.check_invariants()

    # -- reading -------------------------------------------------------------

    def views(self, entry: Entry) -> list[memoryview]:
        """Zero-copy writable views, one per run, trimmed to ``nbytes`` in total.

        They alias region blocks. Use them only while the entry is ALLOCATED
        (you are its writer) or pinned. After that the blocks may belong to
        another entry.
        """
        if entry.state is EntryState.FREED:
            raise NotFound(f"{entry.mm_hash} has been freed")
        return [self._region.view(off, n) for off, n in entry.extents]

    def read(self, mm_hash: str) -> np.ndarray:
        """The entry as an array of its meta dtype and shape (flat uint8 if numpy lacks the dtype).

        A single-run entry comes back as a read-only zero-copy view of the
        region. It is valid only while the entry is not evicted, so hold a pin
        (``Store.pin``) or copy it if the store may evict it meanwhile. A
        multi-run entry comes back as a copy. That copy raises NotFound if
        the entry was evicted while it was being copied.
        """
        entry = self._table.get_ready(mm_hash)
        extents = entry.extents
        if len(extents) == 1:
            off, n = extents[0]
            raw = self._region.array[off : off + n]
            raw.flags.writeable = False  # committed entries are immutable
            return _typed(raw, entry.meta)
        out = np.empty(entry.nbytes, dtype=np.uint8)
        self._copy_out(entry, out)
        return _typed(out, entry.meta)

    def read_into(self, mm_hash: str, out: np.ndarray) -> np.ndarray:
        """Copy the entry into ``out`` (C-contiguous, writable, exactly nbytes). Returns ``out``.

        It takes no pin. It raises NotFound if the entry was evicted during the
        copy, so a copy that returns is never torn.
        """
        if not (out.flags.c_contiguous and out.flags.writeable):
            raise ValueError("out must be a writable C-contiguous array")
        dst = out.reshape(-1).view(np.uint8)
        entry = self._table.get_ready(mm_hash)
        if dst.nbytes != entry.nbytes:
            raise ValueError(f"{mm_hash}: entry holds {entry.nbytes} bytes, out {dst.nbytes}")
        self._copy_out(entry, dst)
        return out

    def checksum(self, entry: Entry) -> int:
        """xxh3-64 of the entry's bytes, hashed run after run (equal to hashing them joined)."""
        digest = xxhash.xxh3_64()
        for view in self.views(entry):
            digest.update(view)
        return digest.intdigest()

    def verify(self, entry: Entry) -> bool:
        """Whether a READY entry's bytes still have the digest recorded at its commit.

        Any peer that holds this node's NIXL metadata can WRITE its region (NIXL
        registers it with every access, and neither cross-memory attach nor UCX's
        TCP transport checks a write at the target), but not the digest: it lives in
        the entry's meta, outside the region. An entry found changed is counted
        (``foreign_writes``) and removed, so that it is never loaded or served again;
        one committed with no digest is taken as it is (True). One pass over the
        bytes: call it while the entry is pinned, just before its bytes are used.
        """
        expected = entry.meta.checksum
        if expected is None:
            return True
        if entry.state not in (EntryState.READY, EntryState.EVICTING):
            return False  # its blocks are no longer its own: nothing to load
        if self.checksum(entry) == expected:
            return True
        with self._count_lock:
            self._foreign_writes += 1
        log.error("%s changed since its commit: dropped", entry.mm_hash)
        self._table.remove(entry.mm_hash, expect=entry)
        return False

    # -- internals -----------------------------------------------------------

    def _words(self, run: Run) -> np.ndarray:
        assert self._canary_words is not None
        per_block = self._block_size // 8
        return self._canary_words[run.start * per_block : run.end * per_block]

    def _fill_canary(self, runs: Sequence[Run]) -> None:
        for run in runs:
            self._words(run).fill(_CANARY_WORD)

    def _check_canary(self, runs: Sequence[Run]) -> None:
        for run in runs:
            changed = np.flatnonzero(self._words(run) != _CANARY_WORD)
            if changed.size:
                # Counted before it is logged: the count is what tests and the
                # fault harness read.
                self._canary_violations += 1
                first = run.start + int(changed[0]) * 8 // self._block_size
                log.error(
                    "write after free: %d words of blocks %d..%d changed while free "
                    "(first in block %d)",
                    changed.size,
                    run.start,
                    run.end - 1,
                    first,
                )

    def _copy_in(self, entry: Entry, src: Bytes) -> None:
        region = self._region.array
        pos = 0
        for off, n in entry.extents:
            np.copyto(region[off : off + n], src[pos : pos + n])
            pos += n

    def _copy_out(self, entry: Entry, dst: Bytes) -> None:
        # An optimistic read that takes no pin, because pin + unpin cost more
        # than a 64 KiB copy. It is checked after the copy. FREED is terminal
        # and blocks are reused only after FREED, so an entry that is not
        # FREED now was never freed during the copy.
        region = self._region.array
        pos = 0
        for off, n in entry.extents:
            np.copyto(dst[pos : pos + n], region[off : off + n])
            pos += n
        if entry.state is EntryState.FREED:
            raise NotFound(f"{entry.mm_hash} was evicted while being read")


def _check_meta(meta: EntryMeta, nbytes: int, mm_hash: str) -> EntryMeta:
    # A wrong shape found here is a clear error. Found on the far side of a
    # transfer, it would be a silently garbled tensor.
    itemsize = dtype_itemsize(meta.dtype)
    if itemsize is None:
        # Its size unknown, its shape could not be checked: refused rather than trusted.
        raise InvalidMeta(f"{mm_hash}: unknown dtype {meta.dtype!r}")
    if math.prod(meta.shape) * itemsize != nbytes:
        raise InvalidMeta(
            f"{mm_hash}: meta {meta.dtype}{list(meta.shape)} is "
            f"{math.prod(meta.shape) * itemsize} bytes, data is {nbytes}"
        )
    return meta


def _typed(raw: Bytes, meta: EntryMeta) -> np.ndarray:
    dtype = numpy_dtype(meta.dtype)
    if dtype is None or math.prod(meta.shape) * dtype.itemsize != raw.nbytes:
        return raw
    return raw.view(dtype).reshape(meta.shape)


def _flat_bytes(arr: np.ndarray) -> Bytes:
    if arr.flags.c_contiguous and arr.dtype.isnative and arr.dtype.kind in PLAIN_KINDS:
        return arr.reshape(-1).view(np.uint8)  # the common case, kept short: no copy
    if arr.dtype.kind not in PLAIN_KINDS:
        raise TypeError(f"cannot store a {arr.dtype} array: only numeric dtypes are plain bytes")
    if not arr.dtype.isnative:
        arr = arr.astype(arr.dtype.newbyteorder("="))
    # ascontiguousarray copies only when the input is strided or transposed.
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def _as_bytes(data: object) -> tuple[Bytes, EntryMeta]:
    """Flat contiguous uint8 bytes of ``data`` (no copy when already contiguous), and its meta."""
    if isinstance(data, np.ndarray):
        arr = data
    elif callable(getattr(data, "numpy", None)):
        return _tensor_bytes(data)
    elif hasattr(data, "__array_interface__") or hasattr(data, "__array__"):
        arr = np.asarray(data)
    elif hasattr(data, "__dlpack__"):
        arr = np.from_dlpack(data)
    else:
        try:
            arr = np.asarray(memoryview(data))  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"cannot store {type(data).__name__}: "
                "expected a buffer, a numpy array or a tensor with .numpy()"
            ) from None
    return _flat_bytes(arr), EntryMeta(dtype=_dtype_name(arr.dtype), shape=arr.shape)


@functools.cache
def _dtype_name(dtype: np.dtype[Any]) -> str:
    return dtype.name  # numpy computes .name in Python; it cost µs per put


def _tensor_bytes(tensor: Any) -> tuple[Bytes, EntryMeta]:
    """Bytes of a torch-like tensor, found by duck typing so torch is never imported here."""
    t = tensor
    for method in ("detach", "cpu", "contiguous"):  # each one returns self when it has no work
        fn = getattr(t, method, None)
        if callable(fn):
            t = fn()
    dtype = str(getattr(t, "dtype", "uint8")).removeprefix("torch.")
    shape = tuple(int(d) for d in getattr(t, "shape", ()))
    try:
        arr = np.asarray(t.numpy())
    except (TypeError, RuntimeError) as exc:
        # numpy has no bfloat16 or float8, so .numpy() refuses them. We view the
        # same bytes as uint8 instead, with the tensor library's own uint8 dtype.
        lib = sys.modules.get(type(t).__module__.partition(".")[0])
        uint8 = getattr(lib, "uint8", None)
        if uint8 is None or not callable(getattr(t, "view", None)):
            raise TypeError(f"cannot get the bytes of a {type(tensor).__name__}") from exc
        flat = t.reshape(-1) if callable(getattr(t, "reshape", None)) else t
        arr = np.asarray(flat.view(uint8).numpy())
    return _flat_bytes(arr), EntryMeta(dtype=dtype, shape=shape)
