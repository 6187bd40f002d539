"""The item directory: which backend holds which item now, fed by the backends' own events.

Each watched backend publishes its store's events (`ecshare.peer.items`): an item stored,
an item evicted, a snapshot of everything held, a heartbeat. This module is the passive
core (no I/O): `apply` takes one decoded message, and says whether the backend should be
asked for a snapshot; `ecshare.apps.proxy.feeds` holds the sockets around it.

What a backend is said to hold is always exactly what its store held at the last sequence
number the directory has seen from it, or less; never more:

* One incarnation at a time: a message from a newer incarnation (a restarted instance)
  drops everything the older one said; messages of an older incarnation are dropped.
* In order or not at all: an event applies only right after its predecessor. A gap (an
  event or heartbeat past the next number) drops the backend's picture until a snapshot
  at least as new as anything seen arrives; duplicates and stale messages are dropped.
* Forgetting is always safe: a backend silent past its timeout (`expire`), one that
  left (`unwatch`), and entries past the `max_items` cap (oldest first) are dropped.
  A hint missing costs an encode or a fetch; the params the proxy sends name the producer,
  and a prefill/decode instance that cannot fetch encodes, so a stale hint never yields a
  wrong embedding.

Every drop is counted (`stats`). Not thread-safe: one per event loop (proxy worker).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final

from ecshare.peer.items import FeedMessage, ItemEvent, ItemHeartbeat, ItemSnapshot

log = logging.getLogger(__name__)

DEFAULT_MAX_ITEMS: Final = 1_000_000

STAT_NAMES: Final = (
    "applied",  # events applied in order
    "snapshots",  # snapshots applied
    "gaps",  # sequence gaps: the backend's picture dropped until a snapshot
    "duplicates",  # events or snapshots not newer than what was applied
    "stale_incarnation",  # messages of an incarnation older than the latest seen
    "restarts",  # a newer incarnation replaced an older one
    "unsynced",  # events that arrived while waiting for a snapshot
    "expired",  # backends silent past their timeout, their picture dropped
    "capped",  # entries dropped to keep under max_items
    "unknown_backend",  # messages for a backend not watched
)


@dataclass
class _Picture:
    encoder: bool
    incarnation: int | None = None
    seq: int = 0  # the last sequence number applied (synced) or seen (not synced)
    synced: bool = False
    heard_at: float | None = None
    items: dict[str, int] = field(default_factory=dict)  # mm_hash -> nbytes


class ItemDirectory:
    """Which backend (by URL) holds which item (by mm_hash), bounded to `max_items` entries."""

    def __init__(self, *, max_items: int = DEFAULT_MAX_ITEMS) -> None:
        if max_items < 1:
            raise ValueError(f"max_items must be at least 1, got {max_items}")
        self._max_items = max_items
        self._pictures: dict[str, _Picture] = {}
        self._holders: dict[str, set[str]] = {}
        # Every (backend, mm_hash) held, oldest first: what the cap drops.
        self._order: OrderedDict[tuple[str, str], None] = OrderedDict()
        self._stats = dict.fromkeys(STAT_NAMES, 0)

    # -- what routing asks ------------------------------------------------------------------

    def holders(self, mm_hash: str) -> frozenset[str]:
        """The backends (encoders and prefill/decode alike) that hold `mm_hash` now."""
        found = self._holders.get(mm_hash)
        return frozenset(found) if found else frozenset()

    def held_count(self, backend: str, mm_hashes: Iterable[str]) -> int:
        """How many of `mm_hashes` `backend` holds."""
        picture = self._pictures.get(backend)
        if picture is None or not picture.items:
            return 0
        return sum(1 for h in mm_hashes if h in picture.items)

    def held_bytes(self, backend: str, mm_hashes: Iterable[str]) -> int:
        """How many bytes of `mm_hashes` `backend` holds."""
        picture = self._pictures.get(backend)
        if picture is None or not picture.items:
            return 0
        return sum(picture.items.get(h, 0) for h in mm_hashes)

    def is_encoder(self, backend: str) -> bool:
        """Whether `backend` was watched as an encoder (False for one not watched)."""
        picture = self._pictures.get(backend)
        return picture is not None and picture.encoder

    def forget(self, backend: str) -> None:
        """Drop what `backend` holds; it stays watched and resyncs from its next snapshot."""
        picture = self._pictures.get(backend)
        if picture is not None:
            self._reset(backend, picture)

    # -- membership -------------------------------------------------------------------------

    def watch(self, backend: str, *, encoder: bool) -> None:
        """Start taking `backend`'s messages (idempotent; its role is updated)."""
        picture = self._pictures.get(backend)
        if picture is None:
            self._pictures[backend] = _Picture(encoder=encoder)
        else:
            picture.encoder = encoder

    def unwatch(self, backend: str) -> None:
        """`backend` left: drop what it holds and everything known of it."""
        picture = self._pictures.pop(backend, None)
        if picture is not None:
            self._drop_items(backend, picture)

    def watched(self) -> list[str]:
        return list(self._pictures)

    # -- the feed ---------------------------------------------------------------------------

    def apply(self, backend: str, message: FeedMessage, now: float) -> bool:
        """Take one message from `backend`; True when a snapshot should be asked for."""
        picture = self._pictures.get(backend)
        if picture is None:
            self._stats["unknown_backend"] += 1
            return False
        if picture.incarnation is not None and message.incarnation < picture.incarnation:
            self._stats["stale_incarnation"] += 1
            return False
        picture.heard_at = now
        if picture.incarnation is None or message.incarnation > picture.incarnation:
            if picture.incarnation is not None:
                self._stats["restarts"] += 1
                log.info("item directory: %s restarted; dropping what it held", backend)
            self._reset(backend, picture)
            picture.incarnation = message.incarnation
            picture.seq = 0
        if isinstance(message, ItemSnapshot):
            return self._snapshot(backend, picture, message)
        if not picture.synced:
            self._stats["unsynced"] += 1
            picture.seq = max(picture.seq, message.seq)
            return True
        if message.seq <= picture.seq:
            if isinstance(message, ItemEvent):
                self._stats["duplicates"] += 1
            return False
        if isinstance(message, ItemHeartbeat) or message.seq != picture.seq + 1:
            self._stats["gaps"] += 1
            log.info("item directory: %s: events lost before #%d; resyncing", backend, message.seq)
            self._reset(backend, picture)
            picture.seq = message.seq
            return True
        picture.seq = message.seq
        self._stats["applied"] += 1
        if message.kind == "stored":
            self._add(backend, picture, message.mm_hash, message.nbytes)
        else:
            self._remove(backend, picture, message.mm_hash)
        return False

    def expire(self, now: float, timeout_s: float) -> list[str]:
        """Drop the pictures of backends not heard from for `timeout_s`; returns them."""
        expired = []
        for backend, picture in self._pictures.items():
            silent = picture.heard_at is not None and now - picture.heard_at > timeout_s
            if silent and (picture.synced or picture.items):
                self._stats["expired"] += 1
                log.warning("item directory: %s silent for %.1f s; forgotten", backend, timeout_s)
                self._reset(backend, picture)
                expired.append(backend)
        return expired

    def synced(self, backend: str) -> bool:
        picture = self._pictures.get(backend)
        return picture is not None and picture.synced

    def stats(self) -> dict[str, int]:
        """Counters (STAT_NAMES), plus `entries`: (backend, item) pairs held now."""
        return {**self._stats, "entries": len(self._order)}

    # -- inside -----------------------------------------------------------------------------

    def _snapshot(self, backend: str, picture: _Picture, message: ItemSnapshot) -> bool:
        # Older than something already seen of this incarnation: it would bring back
        # what a later event took away.
        if message.seq < picture.seq or (picture.synced and message.seq == picture.seq):
            self._stats["duplicates"] += 1
            return not picture.synced
        self._drop_items(backend, picture)
        picture.seq = message.seq
        picture.synced = True
        self._stats["snapshots"] += 1
        for mm_hash, nbytes in message.items:
            self._add(backend, picture, mm_hash, nbytes)
        return False

    def _reset(self, backend: str, picture: _Picture) -> None:
        self._drop_items(backend, picture)
        picture.synced = False

    def _add(self, backend: str, picture: _Picture, mm_hash: str, nbytes: int) -> None:
        key = (backend, mm_hash)
        if mm_hash in picture.items:
            self._order.move_to_end(key)
        else:
            self._holders.setdefault(mm_hash, set()).add(backend)
            self._order[key] = None
        picture.items[mm_hash] = nbytes
        while len(self._order) > self._max_items:
            (old_backend, old_hash), _ = self._order.popitem(last=False)
            self._stats["capped"] += 1
            self._unhold(old_backend, old_hash)
            del self._pictures[old_backend].items[old_hash]

    def _remove(self, backend: str, picture: _Picture, mm_hash: str) -> None:
        if picture.items.pop(mm_hash, None) is not None:
            del self._order[(backend, mm_hash)]
            self._unhold(backend, mm_hash)

    def _drop_items(self, backend: str, picture: _Picture) -> None:
        for mm_hash in picture.items:
            del self._order[(backend, mm_hash)]
            self._unhold(backend, mm_hash)
        picture.items.clear()

    def _unhold(self, backend: str, mm_hash: str) -> None:
        found = self._holders.get(mm_hash)
        if found is not None:
            found.discard(backend)
            if not found:
                del self._holders[mm_hash]
