"""Opt-in timestamps of where a fetch spends its time, for `ecshare bench fetch`.

A `Producer` or `Consumer` whose `phases` is a `PhaseLog` records, per item,
when each step of a fetch happened; with `phases` None (the default) a step
costs one attribute test. The clock is `time.monotonic`, which on Linux is
CLOCK_MONOTONIC and shared by every process of a host, so the producer's and
the consumer's marks of one fetch lie on one time line.

Consumer marks: ``call`` (fetch() entered), ``picked`` (its network thread
took the item), ``sent`` (the FetchRequest is about to go), ``c_woke`` (the
network thread's poll returned with the reply), ``granted`` (the reply was
read), ``read_start`` and ``read_return`` (around the transport's read call,
which on one host copies synchronously), ``done`` (the transport said DONE),
``result`` (the future was resolved). Producer marks: ``p_woke`` (its poll
returned with the request), ``recv`` (the request was read off the socket and
opened) and ``replied`` (the answer is about to go). Each side marks before it
sends, so no step comes out negative.

Each peer hands its log on to the parts that mark steps (`Phased`), so that one
setting reaches every part.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Protocol


class PhaseLog:
    """A bounded record of (item, phase, monotonic time); any thread may take it."""

    def __init__(self, maxlen: int = 65536) -> None:
        self._records: collections.deque[tuple[str, str, float]] = collections.deque(maxlen=maxlen)
        self._lock = threading.Lock()

    def mark(self, key: str, phase: str, at: float | None = None) -> None:
        self._records.append((key, phase, time.monotonic() if at is None else at))

    def take(self) -> list[tuple[str, str, float]]:
        """Every record so far, oldest first; the log is left empty."""
        with self._lock:
            out = []
            while self._records:
                out.append(self._records.popleft())
            return out


class Marks(Protocol):
    """A part of a peer that marks steps in the log it is handed."""

    phases: PhaseLog | None


class Phased:
    """A peer whose `phases` reaches each of its parts that marks steps (`_phased`)."""

    _phases: PhaseLog | None = None
    _phased: tuple[Marks, ...] = ()  # set by the peer once its parts exist

    @property
    def phases(self) -> PhaseLog | None:
        """Per-item timestamps of each step of a fetch and a push; None (the default): off."""
        return self._phases

    @phases.setter
    def phases(self, log: PhaseLog | None) -> None:
        self._phases = log
        for part in self._phased:
            part.phases = log
