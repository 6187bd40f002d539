"""The pins the engine's own scheduler holds on region entries, each keyed by a grant id.

Four kinds, all under one owner (`ENGINE_PIN_OWNER`), each with a grant id of
its own, so that releasing one never touches another:

- **probe** (`probe`): taken by `has_cache_item` at the moment it answers yes,
  by `Store.pin`, which looks the entry up and pins it under one lock.
  vLLM asks `has_cache_item`, and later in the same `schedule()` calls
  `update_state_after_alloc`; without the pin the consumer thread's next
  `allocate` could evict the entry in between, and the engine would have
  neither a load nor an encode planned for the item. A probe becomes the pin
  of the item's load (`take_probe`), or is released when the step's plan is
  built (the request was not scheduled after all).
- **load**: the probe pin of one `LoadOp`, released when the workers report
  that very grant copied (or failed).
- **hold**: one request's hold on an item it will load, from the moment its
  fetch completes (or it finds the item already local) until its load has
  copied or the request ends. A request that waits in the queue keeps its
  item: the region refuses a fetch that would need those blocks
  (`StoreFull`, counted by the consumer as `local_store_full`) rather than
  evict them.
- **fetch**: taken on the consumer's thread the moment a fetch completes,
  before any other allocation there can evict the new entry, and handed on
  as holds to the requests waiting for it (see `fetches`).

Every pin has a lease, the safety net for lost bookkeeping: a pin whose
release never comes is reaped when the lease runs out (by the Producer's
reaper, which reaps every owner's, or on an instance without a Producer by
the scheduler side itself, which reaps only its own).
"""

from __future__ import annotations

import itertools
import typing

import msgspec

from ecshare import protocol as p
from ecshare.store import Entry, Hold, NotFound, NotReady, Store


def _longest_session_id() -> int:
    for meta in typing.get_args(p.Token)[1:]:
        if isinstance(meta, msgspec.Meta) and meta.max_length is not None:
            return meta.max_length
    raise RuntimeError("protocol.Token has no max_length")


# Producer sessions pin under "session:" and their session id, which the client
# chooses (a protocol.Token); ending a session releases its owner's pins. This
# owner has another prefix, and is longer than any session id may be besides, so
# no session can share it and release the engine's pins.
_OWNER_PREFIX = "ecshare.vllm.engine:"
ENGINE_PIN_OWNER = _OWNER_PREFIX + "~" * (_longest_session_id() + 1 - len(_OWNER_PREFIX))


class EnginePins:
    """Pins on one store's entries, owned by the engine; used by the scheduler thread, except
    `pin` and `release`, which `fetches` also calls from the consumer's thread."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._ids = itertools.count(1)
        self._probes: dict[str, str] = {}  # mm_hash -> grant, this step's only

    def pin(self, mm_hash: str, kind: str, lease_s: float) -> tuple[str, Entry] | None:
        """Pin the READY entry of `mm_hash` under a new grant id; None if there is none."""
        grant = f"{kind}-{next(self._ids)}"
        try:
            self._store.pin(mm_hash, ENGINE_PIN_OWNER, grant, lease_s)
        except (NotFound, NotReady):
            return None
        entry = self._store.pinned_entry(ENGINE_PIN_OWNER, grant)
        assert entry is not None  # pinned just now, and only we release it
        if not self._store.verify(entry):
            # A peer wrote the entry's blocks since its commit: the store dropped it, and
            # the item is fetched or encoded again rather than loaded.
            self._store.unpin(ENGINE_PIN_OWNER, grant)
            return None
        return grant, entry

    def hold(self, kind: str, lease_s: float) -> Hold:
        """A pin for the consumer to take as it commits a fetched entry (`FetchItem.hold`)."""
        return Hold(ENGINE_PIN_OWNER, f"{kind}-{next(self._ids)}", lease_s)

    def entry(self, grant: str) -> Entry | None:
        return self._store.pinned_entry(ENGINE_PIN_OWNER, grant)

    def release(self, grant: str) -> bool:
        return self._store.unpin(ENGINE_PIN_OWNER, grant)

    def renew(self, grant: str, lease_s: float) -> bool:
        """Extend a live pin; False if it is gone (released, or reaped after its lease)."""
        return self._store.renew(ENGINE_PIN_OWNER, grant, lease_s)

    # -- this step's probes ------------------------------------------------------------------

    def probed(self, mm_hash: str) -> bool:
        return mm_hash in self._probes

    def add_probe(self, mm_hash: str, grant: str) -> None:
        self._probes[mm_hash] = grant

    def take_probe(self, mm_hash: str) -> str | None:
        """The probe of `mm_hash`, now the pin of its load; None if it was not probed."""
        return self._probes.pop(mm_hash, None)

    def release_probes(self) -> int:
        """Release the probes no load took (their requests were not scheduled); how many."""
        for grant in self._probes.values():
            self.release(grant)
        n, self._probes = len(self._probes), {}
        return n
