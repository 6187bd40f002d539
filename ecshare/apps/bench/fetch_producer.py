"""The fetch bench's producer: a real `Producer` in a child process (`ecshare.apps.bench.child`).

It fills the entries of one size at a time on command and answers, beside
its control-plane address, its data-plane `PeerInfo` (in `Ready`) and each
entry's extents. The harness is trusted: that is how the raw baseline reads
exactly the same remote bytes with none of ecshare's control plane.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection
from typing import Any, TypeVar

import msgspec
import numpy as np

from ecshare.apps.bench.child import ChildGone, ChildPipe, ChildProcess, Ready
from ecshare.config import Config
from ecshare.peer import Node, start_producer
from ecshare.peer.phases import PhaseLog
from ecshare.store import Entry, Store
from ecshare.transport.base import PeerInfo

__all__ = ["FetchProducer", "Fresh", "fill_value"]

Extents = list[tuple[int, int]]
Marks = list[tuple[str, str, float]]  # (item, phase, monotonic time), see ecshare/peer/phases.py
_Answer = TypeVar("_Answer")


# -- commands -------------------------------------------------------------------------------


class FillEntries(msgspec.Struct, frozen=True):
    """Drop every entry held (the last fresh one too), then put `count` of `size` bytes;
    answered with `Entries`."""

    size: int
    count: int


class FreshEntry(msgspec.Struct, frozen=True):
    """Drop the last fresh entry and write a new one of `size` bytes in newly allocated
    blocks, each byte `fill_value(seq)`; answered with `Fresh`."""

    size: int
    seq: int


class Refill(msgspec.Struct, frozen=True):
    """Write `value` over the blocks of an entry no grant holds any more; answered with
    `Done`."""

    mm_hash: str
    value: int


class TakeMarks(msgspec.Struct, frozen=True):
    """Answered with the producer's `Marks` since the last take."""


class ReadCpu(msgspec.Struct, frozen=True):
    """Answered with `CpuTime` of the producer's network thread."""


class ReadCounters(msgspec.Struct, frozen=True):
    """Answered with the producer's `Counters`."""


# -- answers --------------------------------------------------------------------------------


class Entries(msgspec.Struct, frozen=True):
    items: list[tuple[str, Extents]]  # (mm_hash, byte extents), in order


class Fresh(msgspec.Struct, frozen=True):
    mm_hash: str
    extents: Extents
    marks: Marks  # the producer's marks so far


class Done(msgspec.Struct, frozen=True):
    pass


class PhaseMarks(msgspec.Struct, frozen=True):
    marks: Marks


class CpuTime(msgspec.Struct, frozen=True):
    cpu_s: float  # the network thread's CPU clock
    wall_s: float  # time.monotonic() when it was read


class Counters(msgspec.Struct, frozen=True):
    counters: dict[str, int]


def fill_value(index: int) -> int:
    """The byte entry `index` of a fill (or fresh entry `index`) is filled with."""
    return (index * 37 + 11) % 251


# -- in the child ---------------------------------------------------------------------------


def _producer_main(conn: Connection, settings: dict[str, Any], fingerprint: str) -> None:
    pipe = ChildPipe(conn)
    config = Config.from_dict(settings)
    node = Node.create(config, "producer")
    producer = start_producer(node, fingerprint=fingerprint)
    producer.phases = PhaseLog()
    assert producer.thread_ident is not None
    cpu_clock = time.pthread_getcpuclockid(producer.thread_ident)
    store = node.store
    held: list[str] = []
    fresh = ""
    try:
        pipe.send(Ready(os.getpid(), producer.address, producer.port, node.transport.local_info()))
        for cmd in pipe.commands():
            if isinstance(cmd, FillEntries):
                if fresh:  # else the region never empties and _clear stops with an error
                    held.append(fresh)
                    fresh = ""
                _clear(store, held)
                items = []
                for i in range(cmd.count):
                    h = f"bench-{cmd.size}-{i}"
                    entry = store.put(h, np.full(cmd.size, fill_value(i), dtype=np.uint8))
                    held.append(h)
                    items.append((h, entry.byte_extents(store.block_size)))
                pipe.send(Entries(items))
            elif isinstance(cmd, FreshEntry):
                if fresh:
                    store.remove(fresh)
                fresh = f"sporadic-{cmd.size}-{cmd.seq}"
                entry = store.allocate(fresh, cmd.size)
                _fill(store, entry, fill_value(cmd.seq))
                store.commit(entry)
                extents = entry.byte_extents(store.block_size)
                pipe.send(Fresh(fresh, extents, producer.phases.take()))
            elif isinstance(cmd, Refill):
                # The harness knows no one reads this entry any more.
                written = store.get(cmd.mm_hash)
                assert written is not None
                _fill(store, written, cmd.value)
                pipe.send(Done())
            elif isinstance(cmd, TakeMarks):
                pipe.send(PhaseMarks(producer.phases.take()))
            elif isinstance(cmd, ReadCpu):
                pipe.send(CpuTime(time.clock_gettime(cpu_clock), time.monotonic()))
            elif isinstance(cmd, ReadCounters):
                pipe.send(Counters(dict(producer.counters)))
    finally:
        producer.stop()
        node.close()


def _fill(store: Store, entry: Entry, value: int) -> None:
    for view in store.views(entry):
        np.frombuffer(view, dtype=np.uint8).fill(value)


def _clear(store: Store, held: list[str]) -> None:
    for h in held:
        store.remove(h)
    held.clear()
    # A removed entry with a pin left (a Release still in flight) is freed once
    # the pin goes; wait for that, so that the next fill finds the whole region.
    deadline = time.monotonic() + 10
    while (used := store.stats().used_blocks) and time.monotonic() < deadline:
        time.sleep(0.005)
    if used:
        # Every figure after this would be measured on a region that is not the one
        # asked for (and this wait would hide the entry still held).
        raise RuntimeError(
            f"the bench producer's region did not empty within 10 s: {used} blocks are "
            "still held by an entry the bench did not remove or a pin not released"
        )


# -- in the parent --------------------------------------------------------------------------


class FetchProducer:
    """The parent's handle: one typed method a command."""

    def __init__(self, settings: dict[str, Any], fingerprint: str) -> None:
        self._child = ChildProcess(
            "producer",
            _producer_main,
            (settings, fingerprint),
            process_name="ecshare-bench-producer",
            start_timeout_s=60,
        )
        ready = self._child.ready
        assert ready.info is not None
        self.address: str = ready.address
        self.info: PeerInfo = ready.info

    def _call(self, cmd: Any, answer: type[_Answer], timeout_s: float = 120) -> _Answer:
        reply = self._child.call(cmd, timeout_s)
        if not isinstance(reply, answer):
            raise ChildGone(f"{self._child.name}: answered {cmd!r} with {reply!r}")
        return reply

    def fill(self, size: int, count: int) -> list[tuple[str, Extents]]:
        return self._call(FillEntries(size, count), Entries).items

    def fresh(self, size: int, seq: int) -> Fresh:
        return self._call(FreshEntry(size, seq), Fresh)

    def refill(self, mm_hash: str, value: int) -> None:
        self._call(Refill(mm_hash, value), Done)

    def marks(self) -> Marks:
        return self._call(TakeMarks(), PhaseMarks).marks

    def cpu(self) -> tuple[float, float]:
        """(CPU seconds of the producer's network thread, monotonic wall seconds)."""
        t = self._call(ReadCpu(), CpuTime)
        return t.cpu_s, t.wall_s

    def counters(self) -> dict[str, int]:
        return self._call(ReadCounters(), Counters).counters

    def stop(self) -> None:
        self._child.stop(timeout_s=30)
