"""A batch's granted items are read with one data-plane READ, and keep every lifetime rule.

The consumer posts one READ for the items granted in one reply (fewer backend
transfers, items that lie end to end merged into one descriptor). Its handle is
shared: a destination given up early stays fenced until the backend has ended
that whole READ, over UCX TCP where the READ is asynchronous.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import (
    STALLABLE_TCP,
    Keyring,
    MakeConsumer,
    MakeProducer,
    expected,
    stays,
    stored_bytes,
    throttle_progress,
)
from waiting import wait_until

from ecshare.peer import FailureReason, FetchFailed

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
TCP = STALLABLE_TCP


@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_batch_is_read_with_one_read_and_lands_byte_exact(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring, data_plane: str
) -> None:
    sizes = {"b-1": 1, "b-2": 65_537, "b-3": MiB, "b-4": 4_505_600, "b-5": 3 * MiB + 5}
    dp = TCP if data_plane == "tcp" else {"store_canary": True}
    pnode, producer = make_producer(keyring.producer_config(), dp, entries=sizes)
    cnode, consumer = make_consumer(keyring.consumer_config(), dp)

    futures = consumer.fetch(list(sizes), [producer.address])
    results = [f.result(timeout=15) for f in futures]

    for result, (h, n) in zip(results, sizes.items(), strict=True):
        assert (result.mm_hash, result.nbytes, result.peer) == (h, n, producer.address)
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
    counters = consumer.counter_snapshot()
    assert counters["requests"] == 1 and counters["read_posts"] == 1
    assert counters["reads_started"] == len(sizes)
    # One READ for the batch, beside the session's one-byte warm-up read.
    assert counters["warm_ups"] == 1
    assert cnode.transport.reads_started == 1 + 1  # type: ignore[attr-defined]
    wait_until(lambda: pnode.store.stats().pins == 0, timeout_s=5)
    assert consumer.fenced_reads()[0] == 0 and cnode.store.stats().canary_violations == 0


def test_batch_read_given_up_fences_every_destination_until_the_one_read_ends(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring, gate: Any
) -> None:
    """The producer's data plane stalls mid-READ: every item's lease runs out, each
    destination is fenced, and none comes back before the shared READ has ended."""
    short = {"grant_lease_s": 1.0, "fetch_deadline_base_s": 0.5, "fetch_deadline_max_s": 0.8}
    sizes = {f"stall-{i}": 8 * MiB for i in range(3)}
    pnode, producer = make_producer(keyring.producer_config(), TCP, short, entries=sizes)
    throttle_progress(pnode, producer, lambda: gate.wait(10.0))  # stalled: nothing moves
    cnode, consumer = make_consumer(
        keyring.consumer_config(),
        TCP,
        {"fetch_deadline_base_s": 2.5, "fetch_deadline_max_s": 2.5, "grant_lease_s": 3.0},
    )

    futures = consumer.fetch(list(sizes), [producer.address])
    for future in futures:
        with pytest.raises(FetchFailed) as failed:
            future.result(timeout=10)
        assert failed.value.reason is FailureReason.DEADLINE, failed.value
    assert consumer.counter_snapshot()["read_posts"] == 1
    # Beside them, the session's one-block warm-up read, waiting on the producer too.
    assert consumer.counter_snapshot()["warm_ups"] == 1

    # The READ is still in flight: its blocks stay held, not reused, pass after pass.
    def held() -> bool:
        return (cnode.store.stats().quarantined, consumer.fenced_reads()[0]) == (3 + 1, 3)

    assert stays(held, consumer), cnode.store.stats()
    assert all(cnode.store.get(h) is None for h in sizes)

    gate.set()  # the producer progresses; the READ ends and every block comes back
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=10.0)
    counters = consumer.counter_snapshot()
    assert counters["reads_fenced"] == counters["fenced_reads_ended"] == 3
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()
    # The region serves again: the same items, now that the producer moves.
    results = [f.result(timeout=15) for f in consumer.fetch(list(sizes), [producer.address])]
    for result, (h, n) in zip(results, sizes.items(), strict=True):
        assert result.nbytes == n
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
