"""Named counts that any thread may add to: the one counter of the package.

The producer, the consumer and the vLLM connector each count from several threads
(their network thread, a caller lending its own, the engine's scheduler), and
metrics or vLLM read the totals from yet another. `Counts` is a `collections.Counter`
(so `counts["fetched"]` reads one count without a lock) whose writes all go under one
lock: an increment is never lost, `add_all` lands several counts at once (no reader
sees items without their bytes), and `snapshot`/`take` copy every count at one instant.

This module sits beside `ecshare.errors` at the bottom of the layers and imports
nothing of ecshare.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Mapping

__all__ = ["Counts"]


class Counts(Counter[str]):
    """A `Counter` of names to ints whose writes are safe from any thread."""

    def __init__(self, counts: Mapping[str, int] | None = None) -> None:
        super().__init__(counts or {})
        # Held by every write here; an owner may hold it too for figures it keeps
        # beside the counts (a latency histogram), as long as it adds none while held.
        self.lock = threading.Lock()

    def add(self, key: str, n: int = 1) -> None:
        with self.lock:
            self[key] += n

    def add_all(self, counts: Mapping[str, int]) -> None:
        """Several counts in one step, so that no snapshot sees some without the rest."""
        with self.lock:
            self.update(counts)

    def snapshot(self) -> dict[str, int]:
        """Every count, as of one instant."""
        with self.lock:
            return dict(self)

    def take(self) -> dict[str, int]:
        """Every count since the last take, and start again from nothing."""
        with self.lock:
            counts = dict(self)
            self.clear()
        return counts
