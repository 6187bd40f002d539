"""The connector's counters, safe to add to from any thread, and its throttled warnings.

The scheduler thread, the consumer's network thread (fetch completions) and, on
an encode-only instance, the report listener's thread all count; vLLM takes the
totals on its scheduler thread once per step. What a hostile or broken client
can repeat at will is counted every time but logged only once in a while
(`Tally.warn`).
"""

from __future__ import annotations

import logging
import threading
import time

from ecshare.counts import Counts

log = logging.getLogger("ecshare.vllm")
WARN_EVERY_S = 10.0


class Tally:
    def __init__(self) -> None:
        self._counts = Counts()
        self._lock = threading.Lock()  # guards the samples and the warning times
        self._samples: dict[str, list[float]] = {}
        self._warned_at: dict[str, float] = {}

    def add(self, key: str, n: int = 1) -> None:
        self._counts.add(key, n)

    def add_all(self, counts: dict[str, int]) -> None:
        """Several counts in one step, so that no take sees some of them without the
        rest (items without their bytes, say)."""
        self._counts.add_all(counts)

    def sample(self, key: str, seconds: float) -> None:
        """One latency sample of `key` (named `<what>_s`: `fetch_latency_s`)."""
        with self._lock:
            self._samples.setdefault(key, []).append(seconds)

    def take(self) -> tuple[dict[str, int], dict[str, list[float]]]:
        """The counts and latency samples since the last take, and start again."""
        counts = self._counts.take()
        with self._lock:
            samples, self._samples = self._samples, {}
        return counts, samples

    def warn(self, kind: str, message: str) -> None:
        """Log a warning of `kind` at most every WARN_EVERY_S."""
        now = time.monotonic()
        with self._lock:
            if now - self._warned_at.get(kind, -WARN_EVERY_S) < WARN_EVERY_S:
                return
            self._warned_at[kind] = now
        log.warning("ecshare: %s (logged at most every %g s)", message, WARN_EVERY_S)
