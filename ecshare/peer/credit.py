"""Standing credit's ledger (docs/PUSH.md): which sessions agreed to credit, the one
credit each holds unclaimed, when a session the region had no room for tries again,
the credits' ids and their size.

The reservations behind the credits, their claims, commits and fences, are the
inbox's (`ecshare.peer.inbox`); this ledger only says where a credit is due.

Guarantees:
- At most one unclaimed credit per session, and only on a session that agreed to it
  (both sides listed `CAP_PUSH_CREDIT`) whose producer may push here.
- A session whose credit the region had no room for is not tried again for
  `_CREDIT_RETRY_S`.
- A credit id is never reused, not even by a later process.
- A credit is at most `push_credit_bytes` and a quarter of the region's blocks.

Network thread only.
"""

from __future__ import annotations

import itertools
import secrets
from typing import Final, Generic, TypeVar

from ecshare.config import Config
from ecshare.store import Store

# A credit that could not be reserved (the region full) is tried again this much later.
_CREDIT_RETRY_S: Final = 1.0

R = TypeVar("R")  # the inbox's reservation behind a credit
Session = tuple[str, str]  # (the producer's endpoint, session id)


class Credits(Generic[R]):
    def __init__(self, store: Store, config: Config) -> None:
        self._store = store
        self._config = config
        # The credit granted on each session and not claimed yet.
        self._held: dict[Session, R] = {}
        self._retry: dict[Session, float] = {}  # after the region was full
        self._agreed: set[Session] = set()  # that agreed to credit
        # This process's credit ids: never reused, not even by a later process.
        self._ids = (f"k{n}.{secrets.token_hex(6)}" for n in itertools.count(1))

    def agree(self, where: Session) -> None:
        self._agreed.add(where)

    @property
    def wanted(self) -> bool:
        """A session that agreed to credit holds none (the region had no room)."""
        return len(self._held) < len(self._agreed)

    def due(self, where: Session, allowed: bool, now: float) -> int:
        """The size of a credit to grant on `where` now; 0: none."""
        nbytes = self._bytes()
        if (
            not nbytes
            or not allowed
            or where not in self._agreed
            or where in self._held
            or now < self._retry.get(where, 0.0)
        ):
            return 0
        return nbytes

    def unavailable(self, where: Session, now: float) -> None:
        """The region had no room for `where`'s credit: try again later."""
        self._retry[where] = now + _CREDIT_RETRY_S

    def new_id(self) -> str:
        return next(self._ids)

    def granted(self, where: Session, credit: R) -> None:
        self._retry.pop(where, None)
        self._held[where] = credit

    def returned(self, where: Session) -> None:
        """The producer gave `where`'s credit back unused."""
        self._held.pop(where, None)

    def forget(self, where: Session, credit: R) -> None:
        """`credit` is claimed or over: `where` may be granted another."""
        if self._held.get(where) is credit:
            del self._held[where]

    def session_lost(self, where: Session) -> None:
        self._held.pop(where, None)
        self._retry.pop(where, None)
        self._agreed.discard(where)

    def _bytes(self) -> int:
        """A credit's size: `push_credit_bytes`, at most a quarter of the region's blocks."""
        stats = self._store.stats()
        quarter = stats.total_blocks // 4 * stats.block_size
        return min(self._config.push_credit_bytes, quarter) if self._config.push_name else 0
