"""The one counter: no increment lost between threads, takes that start again."""

from __future__ import annotations

import threading

from ecshare.counts import Counts

THREADS = 4
ADDS = 20_000


def test_no_add_is_lost_while_threads_add_and_take() -> None:
    counts = Counts()
    taken: list[dict[str, int]] = []
    done = threading.Event()

    def add() -> None:
        for _ in range(ADDS):
            counts.add("items")
            counts.add_all({"bytes": 10, "items_with_bytes": 1})

    def take() -> None:
        while not done.is_set():
            taken.append(counts.take())

    adders = [threading.Thread(target=add) for _ in range(THREADS)]
    taker = threading.Thread(target=take)
    taker.start()
    for t in adders:
        t.start()
    for t in adders:
        t.join()
    done.set()
    taker.join()
    taken.append(counts.take())
    assert sum(t.get("items", 0) for t in taken) == THREADS * ADDS
    assert sum(t.get("bytes", 0) for t in taken) == THREADS * ADDS * 10
    # add_all lands its counts together: no take saw bytes without their items.
    assert all(t.get("bytes", 0) == 10 * t.get("items_with_bytes", 0) for t in taken)
    assert counts.snapshot() == {}


def test_counts_read_like_a_counter() -> None:
    counts = Counts({"fetched": 2})
    counts.add("fetched", 3)
    assert counts["fetched"] == 5 and counts["never"] == 0
    assert counts.snapshot() == {"fetched": 5}
    assert counts.copy() == {"fetched": 5}
