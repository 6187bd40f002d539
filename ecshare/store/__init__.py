"""The store: a shared-memory region, its block allocator and its entry table.

``Store`` is the one face of the package: everything outside it allocates,
writes, commits, aborts, quarantines, pins and unpins entries through it. The
entry table behind it (``ecshare.store.entries``) is private to the package.
``Region`` and ``BlockAllocator`` are exported for worker processes that only
attach to the region, and for tests; ``dtype_itemsize`` is the one dtype table
(``ecshare.store.dtypes``). Every error derives from ``StoreError``
(and so from ``ecshare.ECShareError``), except the shared ``IllegalTransition``.

May import: ecshare.errors, ecshare.config, ecshare.protocol.
"""

from ecshare.errors import IllegalTransition
from ecshare.store.allocator import AllocatorError, BlockAllocator, Run
from ecshare.store.dtypes import dtype_itemsize
from ecshare.store.entries import (
    DigestMismatch,
    Entry,
    EntryExists,
    EntryMeta,
    EntryState,
    EntryTooLarge,
    Hold,
    InvalidMeta,
    NotFound,
    NotReady,
    Pin,
    PinConflict,
    StoreError,
    StoreFull,
    StoreStats,
)
from ecshare.store.region import Region, RegionError, RegionHandle
from ecshare.store.store import LANDING_BYTES, Store, tail_bytes

__all__ = [
    "LANDING_BYTES",
    "AllocatorError",
    "BlockAllocator",
    "DigestMismatch",
    "Entry",
    "EntryExists",
    "EntryMeta",
    "EntryState",
    "EntryTooLarge",
    "Hold",
    "IllegalTransition",
    "InvalidMeta",
    "NotFound",
    "NotReady",
    "Pin",
    "PinConflict",
    "Region",
    "RegionError",
    "RegionHandle",
    "Run",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreStats",
    "dtype_itemsize",
    "tail_bytes",
]
