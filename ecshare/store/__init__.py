"""The store: a shared-memory region, its block allocator and its entry table.

``Store`` is what the peer layer uses. ``Region``, ``BlockAllocator`` and
``EntryTable`` are exported too, for worker processes that only attach to the
region and for tests.
"""

from ecshare.errors import IllegalTransition
from ecshare.store.allocator import AllocatorError, BlockAllocator, Run
from ecshare.store.entries import (
    Entry,
    EntryExists,
    EntryMeta,
    EntryState,
    EntryTable,
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
from ecshare.store.store import Store

__all__ = [
    "AllocatorError",
    "BlockAllocator",
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
    "Region",
    "RegionError",
    "RegionHandle",
    "Run",
    "Store",
    "StoreError",
    "StoreFull",
    "StoreStats",
]
