"""An item directory whose picture a test sets, for the proxy's reuse-aware routing."""

from __future__ import annotations

from collections.abc import Collection


class HeldItems:
    """An item directory whose picture the test sets: which backend holds which mm_hash.

    The real directory is h-dir's (`ecshare.apps.proxy.directory`, fed by the instances'
    stored/pushed/evicted events), which the lead wires into the proxy; this one has its
    methods (`ecshare.apps.proxy.routing.Directory`) and stands for it where a test says
    what the events would have said."""

    def __init__(self) -> None:
        self.held: dict[str, set[str]] = {}  # backend URL -> mm_hashes
        self.encoders: set[str] = set()

    def hold(self, backend: str, *mm_hashes: str) -> None:
        self.held.setdefault(backend, set()).update(mm_hashes)

    def holders(self, mm_hash: str) -> frozenset[str]:
        return frozenset(url for url, hashes in self.held.items() if mm_hash in hashes)

    def held_count(self, backend: str, mm_hashes: Collection[str]) -> int:
        return len(self.held.get(backend, set()).intersection(mm_hashes))

    def is_encoder(self, backend: str) -> bool:
        return backend in self.encoders

    def forget(self, backend: str) -> None:
        self.held.pop(backend, None)
