"""Fetching across two processes: byte-exact, batched, single-flight."""

from __future__ import annotations

import threading
from concurrent.futures import Future

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import (
    FINGERPRINT,
    Keyring,
    MakeConsumer,
    SpawnProducer,
    expected,
    stored_bytes,
    wait_until,
)

from ecshare.peer import FetchResult
from ecshare.store import EntryState

pytestmark = pytest.mark.timeout(60)

# 1 byte up to 16 MiB; most are not multiples of the 64 KiB block.
BATCH_SIZES = (
    "1:1,4095:1,4096:1,65535:1,65536:1,65537:1,100003:1,1MiB:1,1048577:1,5000000:1,16MiB:1"
)


def test_single_item_fetch_is_byte_exact(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    producer = spawn_producer(synthetic="1000003:1", config=keyring.producer_config())
    ((h, nbytes),) = producer.sizes.items()
    node, consumer = make_consumer(keyring.consumer_config())

    result = consumer.fetch([h], [producer.address])[0].result(timeout=10)

    assert (result.mm_hash, result.nbytes, result.peer) == (h, nbytes, producer.address)
    assert (result.dtype, result.shape) == ("uint8", (nbytes,))
    entry = node.store.get(h)
    assert entry is not None and entry.state is EntryState.READY
    np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes))
    assert consumer.counters["requests"] == 1
    assert consumer.counters["reads_started"] == 1


def test_batch_of_many_sizes_is_byte_exact(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    producer = spawn_producer(synthetic=BATCH_SIZES, config=keyring.producer_config(), hooks=True)
    sizes = producer.sizes
    assert len(sizes) == 11 and min(sizes.values()) == 1 and max(sizes.values()) == 16 << 20
    node, consumer = make_consumer(keyring.consumer_config())

    futures = consumer.fetch(list(sizes), [producer.address])
    results = [f.result(timeout=15) for f in futures]

    for result, (h, nbytes) in zip(results, sizes.items(), strict=True):
        assert (result.mm_hash, result.nbytes, result.peer) == (h, nbytes, producer.address)
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes), err_msg=h)
    # One FetchRequest for the whole batch, seen from both sides.
    assert consumer.counters["fetches"] == len(sizes)
    assert consumer.counters["requests"] == 1
    assert consumer.counters["reads_started"] == len(sizes)
    stats = producer.stats()
    assert stats["counters"]["fetch_requests"] == 1, stats
    assert stats["counters"]["granted"] == len(sizes), stats
    assert stats["counters"].get("duplicate_requests", 0) == 0, stats
    # Every grant ends once its read is done: the consumer releases them all.
    assert wait_until(lambda: producer.stats()["store"]["pins"] == 0, 5.0), producer.stats()
    assert producer.stats()["counters"]["released"] == len(sizes)


def test_concurrent_fetches_of_one_hash_share_one_transfer(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    producer = spawn_producer(synthetic="16MiB:1", config=keyring.producer_config(), hooks=True)
    ((h, nbytes),) = producer.sizes.items()
    node, consumer = make_consumer(keyring.consumer_config(), fingerprint=FINGERPRINT)
    threads_n = 8
    barrier = threading.Barrier(threads_n)
    futures: list[Future[FetchResult]] = []
    lock = threading.Lock()

    def fetch() -> None:
        barrier.wait()
        (future,) = consumer.fetch([h], [producer.address])
        with lock:
            futures.append(future)

    threads = [threading.Thread(target=fetch) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert len(futures) == threads_n
    results = [f.result(timeout=10) for f in futures]

    assert all(r.mm_hash == h and r.nbytes == nbytes for r in results)
    np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes))
    # One transfer: one request, one read, one grant; every other caller joined it
    # (or, arriving after it finished, found the entry already local).
    assert consumer.counters["fetches"] == 1
    assert consumer.counters["requests"] == 1
    assert consumer.counters["reads_started"] == 1
    joined = consumer.counters["single_flight_joins"] + consumer.counters["local_hits"]
    assert joined == threads_n - 1
    assert producer.stats()["counters"]["granted"] == 1
