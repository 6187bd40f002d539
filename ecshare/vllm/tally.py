"""The connector's counters, safe to add to from any thread.

The scheduler thread, the consumer's network thread (fetch completions) and, on
an encode-only instance, the report listener's thread all count; vLLM takes the
totals on its scheduler thread once per step.
"""

from __future__ import annotations

import threading
from collections import Counter


class Tally:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._latencies: list[float] = []

    def add(self, key: str, n: int = 1) -> None:
        with self._lock:
            self._counts[key] += n

    def latency(self, seconds: float) -> None:
        with self._lock:
            self._latencies.append(seconds)

    def take(self) -> tuple[dict[str, int], list[float]]:
        """The counts and latency samples since the last take, and start again."""
        with self._lock:
            counts, self._counts = dict(self._counts), Counter()
            latencies, self._latencies = self._latencies, []
        return counts, latencies
