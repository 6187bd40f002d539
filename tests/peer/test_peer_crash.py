"""Processes that die mid-transfer: nothing hangs, nothing leaks, failover works.

Reads of 64 MiB entries go over UCX's TCP transport (`ucx_tls: tcp` on both
sides), where a READ moves only as the producer progresses. The producer under
test stops progressing once it has granted, so its reads are surely in flight
when the SIGKILL lands.
"""

from __future__ import annotations

import subprocess
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import (
    FAST,
    Keyring,
    MakeConsumer,
    MakeProducer,
    ProducerProcess,
    SpawnProducer,
    child_env,
    expected,
    fetch_command,
    stored_bytes,
    throttle_progress,
)
from waiting import wait_until

from ecshare.config import Config
from ecshare.peer import Consumer, FailureReason, FetchFailed, FetchResult, Node
from ecshare.vllm.servers import popen_session

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
BIG = 64 * MiB
COUNT = 2
# The producer under test stalls by holding back its own progress calls, so its data
# plane must move by them alone: no NIXL progress thread.
TCP: dict[str, Any] = {"ucx_tls": "tcp", "region_bytes": 192 * MiB, "nixl_progress_thread": False}


def _outcomes(
    futures: list[Future[FetchResult]], started: float, wait_s: float
) -> list[tuple[FetchResult | FetchFailed, float]]:
    """Each future's result or typed failure, and when it settled (seconds after start)."""
    out: list[tuple[FetchResult | FetchFailed, float]] = []
    for future in futures:
        left = max(0.0, started + wait_s - time.monotonic())
        error = future.exception(timeout=left)  # raises TimeoutError: a hang
        settled = time.monotonic() - started
        assert error is None or isinstance(error, FetchFailed), error
        out.append((error if isinstance(error, FetchFailed) else future.result(), settled))
    return out


def _fetch_and_kill_mid_read(
    consumer: Consumer, victim: ProducerProcess, peers: list[str]
) -> list[Future[FetchResult]]:
    """Fetch every item of `victim`, and SIGKILL it while its reads are in flight.

    The victim stalls its network thread once it has granted, so the reads cannot
    finish (over TCP they need its progress) and the kill lands mid-read for sure.
    """
    assert victim.command("stall-on-grant 10")["armed"]
    reads = consumer.counters["reads_started"]
    futures = consumer.fetch(list(victim.sizes), peers)
    wait_until(
        lambda: consumer.counters["reads_started"] > reads,
        timeout_s=10.0,
        interval_s=0.001,
        detail=lambda: dict(consumer.counters),
    )
    in_flight = not any(f.done() for f in futures)
    victim.kill()
    assert in_flight, dict(consumer.counters)
    return futures


def _assert_quiet(node: Node, consumer: Consumer) -> None:
    """No destination blocks leak: every used block belongs to a READY entry."""
    wait_until(lambda: consumer.pending() == 0, timeout_s=5.0)
    wait_until(
        lambda: node.store.stats().allocated == 0, timeout_s=5.0, detail=lambda: node.store.stats()
    )
    stats = node.store.stats()
    assert stats.free_blocks + stats.used_blocks == stats.total_blocks
    assert stats.entries == stats.ready and stats.evicting == 0, stats
    assert stats.used_blocks == stats.ready * (BIG // stats.block_size), stats
    node.store.check_invariants()


def test_producer_sigkilled_during_large_read_fails_over_or_fails_within_deadline(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    config = {**keyring.producer_config(), **TCP}
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.map(
            lambda _: spawn_producer(synthetic=f"64MiB:{COUNT}", config=config, hooks=True),
            range(2),
        )
    hashes = list(first.sizes)
    assert hashes == list(second.sizes)  # the same items on both
    node, consumer = make_consumer(keyring.consumer_config(), TCP)
    deadline_s = Config.from_dict({**FAST, **TCP}).fetch_deadline_s(BIG)
    assert deadline_s < FAST["grant_lease_s"]

    # 1. The first producer dies mid-read; the second one holds the same items.
    started = time.monotonic()
    futures = _fetch_and_kill_mid_read(consumer, first, [first.address, second.address])
    outcomes = _outcomes(futures, started, deadline_s + 1.0)

    assert consumer.counters["peer_failures.peer_unreachable"] >= 1
    for (outcome, settled), h in zip(outcomes, hashes, strict=True):
        assert settled <= deadline_s + 0.5, f"{h} settled after {settled:.2f} s"
        if isinstance(outcome, FetchResult):
            np.testing.assert_array_equal(stored_bytes(node, h), expected(h, BIG), err_msg=h)
        else:
            # With a live second copy, only running out of time may end a fetch.
            assert outcome.reason is FailureReason.DEADLINE, outcome
    assert consumer.counters["failovers"] >= 1
    _assert_quiet(node, consumer)

    # 2. No second copy: the second producer dies mid-read too. Every item fails
    #    with a typed reason, within its deadline, and leaves nothing behind.
    for h in hashes:
        node.store.remove(h)
    started = time.monotonic()
    futures = _fetch_and_kill_mid_read(consumer, second, [second.address])
    outcomes = _outcomes(futures, started, deadline_s + 1.0)

    for outcome, settled in outcomes:
        assert settled <= deadline_s + 0.5
        assert isinstance(outcome, FetchFailed), outcome
        assert outcome.reason in (
            FailureReason.PEER_UNREACHABLE,
            FailureReason.TRANSPORT,
            FailureReason.DEADLINE,
        ), outcome
        assert outcome.detail
    _assert_quiet(node, consumer)


def test_consumer_sigkilled_during_read_leaves_pins_to_their_lease(
    make_producer: MakeProducer,
    children: list[subprocess.Popen[str]],
    keyring: Keyring,
) -> None:
    entries = {f"big-{i}": BIG for i in range(COUNT)}
    node, producer = make_producer(keyring.producer_config(), TCP, entries=entries)
    # Once it has granted, the producer's network thread waits at this gate, so the
    # consumer's reads (over TCP they need the producer's progress) stay in flight
    # until the consumer is dead.
    gate = threading.Event()
    throttle_progress(node, producer, lambda: gate.wait(timeout=10.0))
    cmd = fetch_command(
        producer.address, list(entries), {**FAST, **keyring.consumer_config(), **TCP}
    )
    consumer = popen_session(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    children.append(consumer)

    try:
        wait_until(
            lambda: producer.active_grants() >= COUNT or consumer.poll() is not None,
            "the grants, or the consumer's end",
            timeout_s=30.0,
        )
        time.sleep(0.2)  # the grants' reply reaches the consumer, which starts its reads
        consumer.kill()
        killed_at = time.monotonic()
    finally:
        gate.set()
    assert consumer.wait(timeout=10) < 0, consumer.communicate()
    assert producer.counters["granted"] == COUNT
    assert producer.counters["released"] == 0

    # The session ends when its heartbeats stop, but not its grants: for all the
    # producer knows a read is still moving (the control plane alone went
    # quiet), so the pins run to their leases and go then, every one.
    heartbeat_timeout_s = FAST["heartbeat_timeout_s"]
    wait_until(lambda: producer.session_count() == 0, timeout_s=heartbeat_timeout_s + 2.0)
    ended_after = time.monotonic() - killed_at
    assert ended_after < FAST["grant_lease_s"] - 0.5, (
        f"session ended only after {ended_after:.2f} s"
    )
    assert node.store.stats().pins == COUNT, node.store.stats()
    assert producer.counters["grants_left_to_lease"] == COUNT
    wait_until(lambda: node.store.stats().pins == 0, timeout_s=FAST["grant_lease_s"] + 2.0)
    assert producer.active_grants() == 0
    assert producer.counters["sessions_closed"] >= 1
    assert producer.counters["released"] == 0  # nobody released them
    assert producer.counters["leases_expired"] == COUNT
    stats = node.store.stats()
    assert stats.pinned_entries == 0 and stats.ready == COUNT, stats
    node.store.check_invariants()
