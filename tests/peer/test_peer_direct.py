"""Direct reads: a located entry is READ with no request, and kept only if its digest matches.

A producer with `direct_reads` tells each session that agreed where every entry
it commits lies (`Located`, with the entry's xxh3-64). The consumer READs such an
entry at once; nothing pins it at the producer, so the bytes are committed only
if their digest matches, and anything else (a stale place, a lying one, a failed
READ) falls back to a granted read from the same producer. The destination obeys
the rule of every read: given up while the READ may still write it, it stays
fenced until the transport says the READ has ended, over UCX TCP too.

Real NIXL throughout (in this process, or a producer process where a test must
freeze it), and a hand-driven producer (`FakeProducer`, a real control server and
a real NIXL data plane) where the producer must lie.
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, wait
from typing import Any

import msgspec
import numpy as np
import pytest
import xxhash

pytest.importorskip("nixl._api")

from peer_testing import (
    FakeProducer,
    Keyring,
    MakeConsumer,
    MakeProducer,
    ProducerProcess,
    SpawnProducer,
    expected,
    stays,
    stored_bytes,
)
from waiting import wait_until

from ecshare import protocol as p
from ecshare.peer import Consumer, FailureReason, FetchFailed, FetchResult, Node, Producer
from ecshare.peer import lending as consumer_module
from ecshare.peer.lending import LEND_MIN_WAIT_S
from ecshare.peer.locator import DIGEST_MAX, Locator
from ecshare.store import EntryMeta, Store
from ecshare.store.region import Region
from ecshare.transport.base import ReadState

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20
# UCX over TCP, where a READ is asynchronous and moves only as the producer's
# data plane progresses (here NIXL's own progress thread: the default).
TCP = {"ucx_tls": "tcp", "store_canary": True}
CMA = {"store_canary": True}
# A consumer that reads tags back with a NIXL READ, as it does from a producer on
# another host; by default one on this host reads them from the producer's memory
# (`tag_peek`, ecshare/peer/peek.py).
NIXL_TAGS = {"tag_peek": False}


def _up(consumer: Consumer, address: str) -> None:
    """The session is open and its warm-up read has ended."""
    consumer.connect([address])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=10.0)
    wait_until(lambda: consumer.counter_snapshot().get("warm_ups", 0) == 1, timeout_s=5.0)
    wait_until(lambda: not consumer._reads.warming, timeout_s=5.0)


def _stopped(pid: int) -> bool:
    """Every thread of process `pid` is stopped (a SIGSTOP takes effect a moment later)."""
    states = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(state in "tT" for state in states)


def _located(consumer: Consumer, n: int) -> None:
    """Wait until the consumer has heard `n` locations in all."""
    wait_until(
        lambda: consumer.counter_snapshot().get("locations_heard", 0) >= n,
        f"{n} locations heard",
        timeout_s=30.0,
    )


def _probe_copies(consumer: Consumer, address: str, put: Callable[[str, int], object]) -> bool:
    """Fetch one entry of a MiB (`put` writes it at the producer), waited for as a
    scheduler waits; whether the session's READs now end inside the read call, which
    a caller's thread needs before it is lent to a fetch."""
    heard = consumer.counter_snapshot().get("locations_heard", 0)
    put("copy-probe", MiB)
    _located(consumer, heard + 1)
    _result(consumer.fetch(["copy-probe"], [address])[0], "network-thread")
    return consumer._links[address].copies_in_call


@pytest.mark.parametrize("tags", ["peek", "nixl"])
@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_entry_committed_after_the_session_opened_is_read_with_no_request(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    data_plane: str,
    tags: str,
) -> None:
    dp = TCP if data_plane == "tcp" else CMA
    pnode, producer = make_producer(keyring.producer_config(), dp)
    cnode, consumer = make_consumer(
        keyring.consumer_config(), {**dp, **(NIXL_TAGS if tags == "nixl" else {})}
    )
    _up(consumer, producer.address)
    sizes = {"d-1": 1, "d-2": 65_537, "d-3": 4_505_600}
    for h, n in sizes.items():
        pnode.store.put(h, expected(h, n))
    _located(consumer, len(sizes))

    futures = consumer.fetch(list(sizes), [producer.address])
    results = [f.result(timeout=15) for f in futures]

    for result, (h, n) in zip(results, sizes.items(), strict=True):
        assert (result.mm_hash, result.nbytes, result.peer) == (h, n, producer.address)
        assert result.attempts == 0  # no request was sent for it
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == len(sizes)
    assert "requests" not in counters and "direct_reads_stale" not in counters
    if tags == "nixl":
        # Together over DIGEST_MAX: checked by tags, all three back in one more READ.
        assert counters["tag_reads"] == 1 and "tag_peeks" not in counters
    else:
        # The producer runs on this host: every tag read from its memory, the small
        # entries' too (no digest taken), and no READ of tags at all.
        assert counters["tag_peeks"] == 3 and "tag_reads" not in counters
    pcounters = dict(producer.counters)
    assert "granted" not in pcounters and "fetch_requests" not in pcounters
    assert pcounters["located"] == len(sizes)
    # The node's region holds its blocks and, past them, their tags.
    assert pnode.store.stats().total_blocks == 64 * MiB // pnode.store.block_size
    assert pnode.store.stats().pins == 0  # the digests' pins are gone
    assert consumer.fenced_reads()[0] == 0
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


def _result(future: Future[FetchResult], how: str) -> FetchResult:
    """`future`'s result, waited for as `how` says: "network-thread" as an engine's
    scheduler waits (never blocking on the future: the network thread makes the
    READ), anything else by blocking on it (which lends this thread to a direct read
    still queued)."""
    if how == "network-thread":
        wait([future], timeout=10)
        return future.result(timeout=0)
    return future.result(timeout=10)


@pytest.mark.parametrize("how", ["network-thread", "lent", "read-here"])
@pytest.mark.parametrize(
    ("n", "peek"),
    [(65_537, False), (3 * MiB + 5, False), (MiB, True), (3 * MiB + 5, True)],
    ids=["by-digest", "by-tag-read", "by-tag-peek", "over-digest-max-by-tag-peek"],
)
def test_stale_location_is_never_committed_and_the_fetch_asks_the_producer(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    n: int,
    peek: bool,
    how: str,
) -> None:
    """The entry is evicted and its blocks hold another's bytes by the time it is
    fetched: the direct READ reads the other entry, its digest (up to DIGEST_MAX)
    or its tag (above) shows it, nothing is committed, and the producer is asked
    (and says it is gone). The same when the READ is made on the caller's thread,
    asked for (`read_here`) or lent to the fetch by blocking on its result; and with
    the tag read from the producer's memory (`peek`), from `PEEK_OVER_DIGEST` up."""
    pnode, producer = make_producer(keyring.producer_config(), CMA)
    cnode, consumer = make_consumer(
        keyring.consumer_config(), CMA if peek else {**CMA, **NIXL_TAGS}
    )
    _up(consumer, producer.address)
    put = lambda h, size: pnode.store.put(h, expected(h, size))  # noqa: E731
    assert _probe_copies(consumer, producer.address, put)  # on one host: lent when blocked on
    old = pnode.store.put("old", expected("old", n))
    _located(consumer, 2)
    pnode.store.remove("old")
    new = pnode.store.put("new", expected("new", n))
    assert new.extents == old.extents  # the same blocks, now another entry's
    _located(consumer, 3)

    future = consumer.fetch(["old"], [producer.address], read_here=how == "read-here")[0]
    with pytest.raises(FetchFailed) as failed:
        _result(future, how)

    assert failed.value.reason is FailureReason.MISSING, failed.value
    assert cnode.store.get("old") is None
    counters = consumer.counter_snapshot()
    assert "read_lent" not in counters  # the stale read committed nothing, wherever made
    assert counters["direct_reads"] == 2 and counters["direct_reads_stale"] == 1
    if peek:  # the probe's entry's tag, and the stale one's
        assert counters["tag_peeks"] == 2 and "tag_reads" not in counters
    else:
        assert counters.get("tag_reads", 0) == (1 if n > DIGEST_MAX else 0)
        assert "tag_peeks" not in counters
    assert counters["requests"] == 1  # the fallback asked the producer
    assert dict(producer.counters)["refused_missing"] == 1
    # The other entry's place is known and right: read directly, byte-exact.
    assert consumer.fetch(["new"], [producer.address])[0].result(timeout=10).attempts == 0
    np.testing.assert_array_equal(stored_bytes(cnode, "new"), expected("new", n))
    assert consumer.counter_snapshot()["direct_reads"] == 3
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_read_here_reads_located_entries_on_the_calling_thread(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring, data_plane: str
) -> None:
    """`fetch(read_here=True)` while the network thread sleeps: on one host the READ
    (and the tag READ) is made, checked and committed inside the call, and the future
    is resolved when it returns. Over TCP the READ leaves the call still moving, and
    the network thread ends it. An entry whose place is not known goes to the network
    thread as ever."""
    dp = TCP if data_plane == "tcp" else CMA
    pnode, producer = make_producer(keyring.producer_config(), dp)
    cnode, consumer = make_consumer(keyring.consumer_config(), dp)
    _up(consumer, producer.address)
    sizes = {"here-1": 65_537, "here-2": 3 * MiB + 5}  # by digest, by tag
    for h, n in sizes.items():
        pnode.store.put(h, expected(h, n))
    _located(consumer, len(sizes))

    done_on_return = []
    for h, n in sizes.items():
        future = consumer.fetch([h], [producer.address], read_here=True)[0]
        done_on_return.append(future.done())
        result = future.result(timeout=15)
        assert (result.nbytes, result.attempts) == (n, 0)  # no request was sent
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == len(sizes), counters
    assert "requests" not in counters and "direct_reads_stale" not in counters
    if data_plane == "cma":
        # The network thread may be in a pass of its own (a heartbeat) when a fetch
        # comes; then that fetch is its. It sleeps nearly all the time.
        assert counters["read_here"] >= 1, counters
        assert sum(done_on_return) == counters["read_here"], (done_on_return, counters)
    with pytest.raises(FetchFailed) as failed:  # never located: asked for, and missing
        consumer.fetch(["nowhere"], [producer.address], read_here=True)[0].result(timeout=10)
    assert failed.value.reason is FailureReason.MISSING
    assert consumer.fenced_reads()[0] == 0
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


def test_read_here_from_many_threads_at_once_delivers_every_fetch_whole(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """Four callers fetch with `read_here` at once, with the network thread busy
    with some of the same fetches: one caller at a time reads on its thread (and may
    read others' items), the rest go to the network thread; every fetch ends once,
    with its own bytes."""
    pnode, producer = make_producer(keyring.producer_config(), CMA)
    cnode, consumer = make_consumer(keyring.consumer_config(), CMA)
    _up(consumer, producer.address)
    sizes = {f"many-{i}": 4096 + 997 * i for i in range(48)}
    for h, n in sizes.items():
        pnode.store.put(h, expected(h, n))
    _located(consumer, len(sizes))
    names = list(sizes)
    results: dict[str, int] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def caller(part: list[str]) -> None:
        try:
            for h in part:
                futures = consumer.fetch([h, "missing"], [producer.address], read_here=True)
                got = futures[0].result(timeout=15)
                with pytest.raises(FetchFailed):
                    futures[1].result(timeout=15)
                with lock:
                    results[h] = got.nbytes
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=caller, args=(names[i::4],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert results == sizes
    for h, n in sizes.items():
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == len(sizes) and "direct_reads_stale" not in counters
    assert counters["fetched"] == len(sizes)
    assert 0 < counters["read_here"] <= len(sizes), counters  # some on the callers' threads
    assert consumer.pending() == 0 and consumer.fenced_reads()[0] == 0
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


@pytest.mark.parametrize("data_plane", ["cma", "tcp"])
def test_a_caller_blocking_on_the_result_lends_its_thread_to_the_direct_read(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    data_plane: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A plain fetch() hands its fetches to the network thread and returns. A caller
    that then blocks on a result while the direct read is still queued makes the READ
    on its own thread, where the session's READs end inside the read call (one host,
    as its last READ of a MiB showed): the bytes are read, checked and committed
    there, and the future is resolved by that thread. With UCX_TLS=tcp nothing is
    lent: the network thread makes every READ. A wait shorter than LEND_MIN_WAIT_S
    lends nothing (a READ on the caller's thread cannot be cut short)."""
    dp = TCP if data_plane == "tcp" else CMA
    pnode, producer = make_producer(keyring.producer_config(), dp)
    cnode, consumer = make_consumer(keyring.consumer_config(), dp)
    _up(consumer, producer.address)
    put = lambda h, size: pnode.store.put(h, expected(h, size))  # noqa: E731
    if data_plane == "tcp":
        # Every READ ends inside the read call, as a fast one over loopback sometimes
        # does: what keeps the caller's thread out is the transport's own word.
        real_read = cnode.transport.read

        def read_to_its_end(peer: str, segments: Any, notify: bytes = b"") -> Any:
            handle = real_read(peer, segments, notify)
            while cnode.transport.poll(handle).state is ReadState.PENDING:
                time.sleep(0.0001)
            return handle

        monkeypatch.setattr(cnode.transport, "read", read_to_its_end)
    copies = _probe_copies(consumer, producer.address, put)
    if data_plane == "cma":
        assert copies  # cross-memory attach: every READ is a copy inside the call
    else:
        # UCX_TLS=tcp: no READ is worth lending a thread to (though a fast one over
        # loopback may end inside the call), and none is lent.
        assert not cnode.transport.may_copy_in_call and not copies
    sizes = {f"lent-{i}": n for i, n in enumerate([65_537, 3 * MiB + 5] * 4)}  # digest, tag
    for h, n in sizes.items():
        pnode.store.put(h, expected(h, n))
    _located(consumer, len(sizes) + 1)
    if data_plane == "cma":
        # fetch() wakes the network thread as well, and which of the two threads takes
        # the lock first is a race that the other core's load decides. Unwoken, that
        # thread sleeps nearly all the time (it may wake for a timer of its own), so
        # the caller is first: what is checked is what happens when it is.
        assert consumer._waker is not None
        monkeypatch.setattr(consumer._waker, "wake", lambda: None)

    resolved_here = []
    for h, n in sizes.items():
        future = consumer.fetch([h], [producer.address])[0]
        resolvers: list[threading.Thread] = []
        done_at_once = future.done()  # then the callback runs at once, on this thread
        future.add_done_callback(lambda _, r=resolvers: r.append(threading.current_thread()))
        result = future.result(timeout=15)
        assert (result.nbytes, result.attempts) == (n, 0)  # read directly, no request
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
        resolved_here.append(not done_at_once and resolvers == [threading.current_thread()])
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == len(sizes) + 1, counters
    assert "requests" not in counters and "read_here" not in counters
    if data_plane == "cma":
        assert counters["read_lent"] >= len(sizes) - 1, counters
        assert sum(resolved_here) == counters["read_lent"], (resolved_here, counters)
    else:
        assert "read_lent" not in counters, counters
        assert not consumer._links[producer.address].copies_in_call  # 8 READs later

    lent = counters.get("read_lent", 0)
    monkeypatch.undo()
    for i in range(3):
        h = f"short-{i}"
        pnode.store.put(h, expected(h, 4096))
        _located(consumer, len(sizes) + i + 2)
        consumer.fetch([h], [producer.address])[0].result(timeout=LEND_MIN_WAIT_S / 2)
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, 4096), err_msg=h)
    assert consumer.counter_snapshot().get("read_lent", 0) == lent  # none lent
    assert consumer.fenced_reads()[0] == 0
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


def test_a_fetch_future_lends_only_while_its_consumer_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The future holds its consumer's lending weakly: it lends on a blocking wait
    of at least LEND_MIN_WAIT_S while unfinished, never once done, never on a shorter
    wait, and never once the consumer is gone."""
    monkeypatch.setattr(consumer_module, "LEND_MIN_WAIT_S", 0.05)
    lent: list[int] = []

    class Owner:
        def _lend(self) -> None:
            lent.append(1)

    owner = Owner()
    future = consumer_module.Fetching(weakref.ref(owner))  # type: ignore[arg-type]
    assert future.running()  # from the start, as every fetch's
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    assert lent == [1]
    with pytest.raises(TimeoutError):
        future.exception(timeout=0.06)
    assert lent == [1, 1]
    with pytest.raises(TimeoutError):
        future.result(timeout=0.01)  # too short to lend
    assert lent == [1, 1]
    del owner
    gc.collect()
    with pytest.raises(TimeoutError):
        future.result(timeout=0.05)
    assert lent == [1, 1]  # its consumer is gone
    done = consumer_module.Fetching(weakref.ref(Owner()))  # type: ignore[arg-type]
    done.set_exception(FetchFailed("x", FailureReason.MISSING))
    assert isinstance(done.exception(), FetchFailed)
    assert lent == [1, 1]


@pytest.mark.parametrize("how", ["read-here", "lent"])
def test_read_here_from_a_producer_killed_meanwhile_ends_typed_on_the_network_thread(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring, how: str
) -> None:
    """The producer process is SIGKILLed after it told where an entry lies: the READ
    made on the caller's thread (asked for, or lent by blocking on the result) fails,
    the caller's thread leaves the lost session to the network thread (which alone
    may close its sockets), and the fetch ends typed; the consumer serves on."""
    producer = spawn_producer(synthetic="", config={**keyring.producer_config(), **CMA}, hooks=True)
    cnode, consumer = make_consumer(keyring.consumer_config(), CMA)
    _up(consumer, producer.address)
    if how == "lent":  # lent only where the session's READs end inside the call
        assert _probe_copies(
            consumer, producer.address, lambda h, n: producer.command(f"put {h} {n}")
        )
    h, n = "killed", 2 * MiB
    heard = consumer.counter_snapshot().get("locations_heard", 0)
    assert producer.command(f"put {h} {n}") == {"put": h}
    _located(consumer, heard + 1)
    os.kill(producer.process.pid, signal.SIGKILL)
    producer.process.wait(10)

    future = consumer.fetch([h], [producer.address], read_here=how == "read-here")[0]
    error = future.exception(timeout=15)

    assert isinstance(error, FetchFailed), error
    assert consumer.failure is None  # the network thread lives on
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == (2 if how == "lent" else 1), counters
    assert "read_here" not in counters and "read_lent" not in counters
    assert counters["peer_failures.peer_unreachable"] == 1, counters
    assert cnode.store.get(h) is None and cnode.store.stats().quarantined == 0
    assert consumer.fenced_reads()[0] == 0
    cnode.store.check_invariants()


def test_relocated_entry_is_read_where_it_lies_now(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    pnode, producer = make_producer(keyring.producer_config(), CMA)
    cnode, consumer = make_consumer(keyring.consumer_config(), CMA)
    _up(consumer, producer.address)
    pnode.store.put("pad", expected("pad", MiB))
    first = pnode.store.put("h", expected("h", MiB))
    _located(consumer, 2)
    pnode.store.remove("pad")
    pnode.store.remove("h")
    pnode.store.put("other", expected("other", 2 * MiB))  # takes h's old blocks
    _located(consumer, 3)
    second = pnode.store.put("h", expected("h", MiB))
    assert second.extents != first.extents
    _located(consumer, 4)

    result = consumer.fetch(["h"], [producer.address])[0].result(timeout=10)

    assert result.attempts == 0
    np.testing.assert_array_equal(stored_bytes(cnode, "h"), expected("h", MiB))
    assert "direct_reads_stale" not in consumer.counter_snapshot()


@pytest.mark.parametrize("off", ["producer", "consumer"])
def test_direct_reads_off_on_either_side_keeps_every_fetch_granted(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    off: str,
) -> None:
    pnode, producer = make_producer(
        keyring.producer_config(), CMA, {"direct_reads": off != "producer"}
    )
    cnode, consumer = make_consumer(
        keyring.consumer_config(), CMA, {"direct_reads": off != "consumer"}
    )
    _up(consumer, producer.address)
    pnode.store.put("h", expected("h", MiB))
    # Room for a Located that must not come.
    assert stays(lambda: "locations_heard" not in consumer.counter_snapshot(), consumer)

    result = consumer.fetch(["h"], [producer.address])[0].result(timeout=10)

    assert result.attempts == 1
    np.testing.assert_array_equal(stored_bytes(cnode, "h"), expected("h", MiB))
    counters = consumer.counter_snapshot()
    assert counters["requests"] == 1 and "direct_reads" not in counters
    assert "locations_heard" not in counters
    assert "located_sent" not in dict(producer.counters)


def test_producer_whose_reads_need_its_own_loop_offers_no_direct_reads(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    # Without NIXL's progress thread a READ nobody granted would get no progress
    # over TCP from the producer's loop, which progresses only for grants.
    pnode, producer = make_producer(keyring.producer_config(), {"nixl_progress_thread": False})
    _, consumer = make_consumer(keyring.consumer_config())
    _up(consumer, producer.address)
    pnode.store.put("h", expected("h", 65_536))

    result = consumer.fetch(["h"], [producer.address])[0].result(timeout=10)

    assert result.attempts == 1
    assert not consumer._links[producer.address].direct
    assert "located_sent" not in dict(producer.counters)


# -- a producer that lies --------------------------------------------------------------------


def _welcomed(fake: FakeProducer, consumer: Consumer) -> None:
    consumer.connect([fake.address])
    hello: p.Hello = fake.recv(p.Hello)
    assert p.CAP_READ_DIRECT in hello.capabilities
    fake.welcome(hello, [p.CAP_READ_DIRECT, p.CAP_CHECKSUM_XXH3_64])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=5.0)
    wait_until(lambda: not consumer._reads.warming, timeout_s=5.0)  # the data plane is wired up


def _location(mm_hash: str, extents: list[tuple[int, int]], checksum: int) -> p.Location:
    nbytes = sum(n for _, n in extents)
    return p.Location(
        mm_hash=mm_hash,
        extents=[p.Extent(o, n) for o, n in extents],
        nbytes=nbytes,
        dtype="uint8",
        shape=[nbytes],
        checksum=checksum,
    )


def test_lying_locations_are_dropped_or_caught_and_the_fetch_is_granted(
    fake_producer: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    fake = fake_producer
    n = 100_000
    data = expected("h", n)
    fake.mm[:n] = data.tobytes()
    cnode, consumer = make_consumer(keyring.consumer_config(), CMA)
    _welcomed(fake, consumer)
    right = xxhash.xxh3_64_intdigest(data.tobytes())

    def tell(session_id: str, *where: p.Location) -> None:
        fake.server.send(fake.route, p.Located(session_id=session_id, entries=list(where)))

    # Beyond the region, or extents that do not add up: dropped, counted.
    tell(fake.session_id, _location("h", [(1 << 20, 4096)], right))
    bad_sum = msgspec.structs.replace(_location("h", [(0, n)], right), nbytes=n + 1)
    tell(fake.session_id, bad_sum)
    # Another session's word: dropped, counted.
    tell("not-this-session", _location("h", [(0, n)], right))
    wait_until(lambda: consumer.counter_snapshot().get("bad_locations", 0) == 2, timeout_s=5.0)
    wait_until(
        lambda: consumer.counter_snapshot().get("locations_off_session", 0) == 1, timeout_s=5.0
    )
    # A wrong digest: read, caught, not committed; the fetch asks for a grant.
    tell(fake.session_id, _location("h", [(0, n)], right ^ 1))
    _located(consumer, 1)  # the dropped ones are not counted as heard

    future = consumer.fetch(["h"], [fake.address])[0]
    request: p.FetchRequest = fake.recv(p.FetchRequest)
    assert cnode.store.get("h") is None  # nothing committed from the direct read
    fake.server.send(
        fake.route,
        p.FetchReply(
            request_id=request.request_id,
            items=[
                p.ItemReply(
                    mm_hash="h",
                    status=p.ItemStatus.GRANTED,
                    grant_id="g1",
                    extents=[p.Extent(0, n)],
                    nbytes=n,
                    dtype="uint8",
                    shape=[n],
                    checksum=right,
                    lease_ms=3000,
                )
            ],
        ),
    )
    result = future.result(timeout=10)

    assert result.attempts == 1
    np.testing.assert_array_equal(stored_bytes(cnode, "h"), data)
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == 1 and counters["direct_reads_stale"] == 1
    assert cnode.store.stats().canary_violations == 0


@pytest.mark.parametrize("tags", ["peek", "nixl"])
def test_a_tag_that_is_not_in_place_is_caught_and_a_bad_one_dropped(
    fake_producer: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring, tags: str
) -> None:
    fake = fake_producer
    n = MiB - 4096  # the fake's region is 1 MiB: the bytes, then a word at its end
    data = expected("t", n)
    word = (1 << 20) - 8
    fake.mm[:n] = data.tobytes()
    fake.mm[word:] = (41).to_bytes(8, "little")
    cnode, consumer = make_consumer(
        keyring.consumer_config(), {**CMA, **(NIXL_TAGS if tags == "nixl" else {})}
    )
    _welcomed(fake, consumer)

    def tag(offset: int, value: int) -> p.Location:
        return msgspec.structs.replace(
            _location("t", [(0, n)], 0), checksum=None, tag=value, tag_offset=offset
        )

    for bad in (tag(word + 4, 41), tag(1 << 20, 41)):  # unaligned; past the region
        fake.server.send(fake.route, p.Located(session_id=fake.session_id, entries=[bad]))
    wait_until(lambda: consumer.counter_snapshot().get("bad_locations", 0) == 2, timeout_s=5.0)
    # The word holds 41, not 42: another entry's blocks by now.
    fake.server.send(fake.route, p.Located(session_id=fake.session_id, entries=[tag(word, 42)]))
    _located(consumer, 1)

    future = consumer.fetch(["t"], [fake.address])[0]
    request: p.FetchRequest = fake.recv(p.FetchRequest)
    assert cnode.store.get("t") is None  # nothing committed from the direct read
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == 1, counters
    assert counters.get("direct_reads_stale") == 1, counters
    assert counters.get("tag_reads" if tags == "nixl" else "tag_peeks") == 1, counters
    fake.server.send(fake.route, p.FetchReply(request_id=request.request_id, items=[_missing("t")]))
    with pytest.raises(FetchFailed):
        future.result(timeout=10)
    assert cnode.store.get("t") is None
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


def _missing(mm_hash: str) -> p.ItemReply:
    return p.ItemReply(mm_hash=mm_hash, status=p.ItemStatus.MISSING)


# -- lifetimes over TCP ----------------------------------------------------------------------


def _located_in_a_process(
    spawn_producer: SpawnProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    h: str,
    n: int,
    consumer_config: dict[str, Any] | None = None,
) -> tuple[ProducerProcess, Node, Consumer]:
    """A producer process over UCX TCP that a test may freeze, holding `h` (`n` bytes),
    and a consumer that gives a fetch up after 0.5 s and has heard where `h` lies."""
    producer = spawn_producer(synthetic="", config={**keyring.producer_config(), **TCP}, hooks=True)
    cnode, consumer = make_consumer(
        keyring.consumer_config(),
        TCP,
        {"fetch_deadline_base_s": 0.5, "fetch_deadline_max_s": 0.5, **(consumer_config or {})},
    )
    _up(consumer, producer.address)
    assert producer.command(f"put {h} {n}") == {"put": h}
    _located(consumer, 1)
    return producer, cnode, consumer


def _thawed_and_whole(
    producer: ProducerProcess, cnode: Node, consumer: Consumer, h: str, n: int, fenced: int = 1
) -> None:
    """After the thaw: the READ given up has ended and its blocks (`fenced` reads'
    worth) and slots are back, nothing was written into freed blocks, and the
    producer serves `h` again, byte-exact."""
    wait_until(lambda: cnode.store.stats().quarantined == 0, timeout_s=15.0)
    wait_until(lambda: consumer.tag_reads_held() == 0, timeout_s=15.0)
    counters = consumer.counter_snapshot()
    assert counters.get("fenced_reads_ended", 0) == fenced and consumer.fenced_reads()[0] == 0
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()

    # The freeze may have outlasted the heartbeat timeout (the fetch gives up first, but
    # a loaded host can stretch what follows): the session then ended, and a consumer
    # that takes no push makes it again only when asked.
    def up() -> bool:
        consumer.connect([producer.address])
        return [x.up for x in consumer.peer_liveness()] == [True]

    wait_until(up, "the session to the thawed producer", timeout_s=15.0, interval_s=0.1)
    result = consumer.fetch([h], [producer.address])[0].result(timeout=15)
    assert result.nbytes == n
    np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))


def test_direct_read_given_up_over_tcp_is_fenced_until_the_read_ends(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """The producer process freezes with a direct READ of 8 MiB in flight: the fetch
    gives up, its destination stays held while the READ may still write it, and
    comes back only once the producer thaws and the READ has ended."""
    h, n = "frozen", 8 * MiB
    producer, cnode, consumer = _located_in_a_process(spawn_producer, make_consumer, keyring, h, n)

    os.kill(producer.process.pid, signal.SIGSTOP)
    try:
        with pytest.raises(FetchFailed):
            consumer.fetch([h], [producer.address])[0].result(timeout=10)
        counters = consumer.counter_snapshot()
        assert counters["direct_reads"] == 1 and counters["reads_fenced"] == 1
        # The READ is still in flight: its blocks are held, not reused.
        assert stays(
            lambda: (consumer.fenced_reads()[0], cnode.store.stats().quarantined) == (1, 1),
            consumer,
        ), cnode.store.stats()
        assert cnode.store.get(h) is None
    finally:
        os.kill(producer.process.pid, signal.SIGCONT)

    _thawed_and_whole(producer, cnode, consumer, h, n)


def test_producer_frozen_during_the_tag_read_keeps_its_slot_held_over_tcp(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """The bytes of a direct read of 8 MiB have landed, and the producer process
    freezes just as the READ of the entry's tag goes out. That READ writes a slot of
    the landing, nothing else: the fetch gives up, nothing is committed, the
    destination goes back at once (its READ has ended), and the slot stays held
    until the producer thaws and the tag READ has ended. The canary shows that
    nothing landed in the freed blocks meanwhile.

    The freeze is timed by wrapping the consumer's real transport: the test stops
    the producer right before the tag READ (8 bytes at the tag's offset) is posted."""
    h, n = "frozen-at-tag", 8 * MiB
    producer, cnode, consumer = _located_in_a_process(
        spawn_producer, make_consumer, keyring, h, n, NIXL_TAGS
    )
    transport = consumer._transport
    real_read = transport.read
    frozen: list[int] = []

    def read(peer: str, segments: Any, notify: bytes = b"") -> Any:
        if not frozen and all(s.length == 8 for s in segments):  # the tag READ
            os.kill(producer.process.pid, signal.SIGSTOP)
            # Every thread of it stopped: one still sending the bytes would answer.
            wait_until(lambda: _stopped(producer.process.pid), timeout_s=5.0)
            frozen.append(sum(s.length for s in segments))
        return real_read(peer, segments, notify)

    transport.read = read  # type: ignore[method-assign]
    try:
        error = consumer.fetch([h], [producer.address])[0].exception(timeout=10)
        counters = consumer.counter_snapshot()
        assert isinstance(error, FetchFailed), f"{frozen} {sorted(counters.items())}"
        assert frozen == [8]  # the bytes had landed; only the tag READ was to go
        assert counters["direct_reads"] == 1 and counters["tag_reads"] == 1
        assert "reads_fenced" not in counters and counters["tag_reads_fenced"] == 1
        # The tag READ is still in flight: its slot stays held; the blocks are back already.
        assert stays(
            lambda: (
                (
                    consumer.tag_reads_held(),
                    consumer.fenced_reads()[0],
                    cnode.store.stats().quarantined,
                )
                == (1, 0, 0)
            ),
            consumer,
        ), cnode.store.stats()
        assert cnode.store.get(h) is None
    finally:
        transport.read = real_read  # type: ignore[method-assign]
        if frozen:
            os.kill(producer.process.pid, signal.SIGCONT)

    _thawed_and_whole(producer, cnode, consumer, h, n, fenced=0)


def test_a_batchs_tags_come_back_in_one_descriptor_and_a_stale_one_is_caught(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """Entries written one after another have their tags side by side: one fetch of
    them READs all their tags with one descriptor over the span. Each is checked
    against its own word of it: the one whose blocks went to another entry falls
    back to the producer, the others are kept."""
    pnode, producer = make_producer(keyring.producer_config(), CMA)
    cnode, consumer = make_consumer(keyring.consumer_config(), CMA, NIXL_TAGS)
    _up(consumer, producer.address)
    names, n = ["a", "b", "c", "d"], 2 * MiB
    entries = {h: pnode.store.put(h, expected(h, n)) for h in names}
    _located(consumer, 4)
    pnode.store.remove("b")
    assert pnode.store.put("b2", expected("b2", n)).extents == entries["b"].extents  # reused
    _located(consumer, 5)
    transport = consumer._transport
    real_read = transport.read
    posted: list[list[Any]] = []

    def read(peer: str, segments: Any, notify: bytes = b"") -> Any:
        posted.append(list(segments))
        return real_read(peer, segments, notify)

    transport.read = read  # type: ignore[method-assign]
    try:
        futures = consumer.fetch(names, [producer.address])
        outcomes = [f.exception(timeout=10) or f.result() for f in futures]
    finally:
        transport.read = real_read  # type: ignore[method-assign]

    assert isinstance(outcomes[1], FetchFailed) and outcomes[1].reason is FailureReason.MISSING
    for h, outcome in zip(names, outcomes, strict=True):
        if h != "b":
            assert outcome.attempts == 0, h  # type: ignore[union-attr]
            np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
    assert cnode.store.get("b") is None
    # The bytes in one READ, then the four tags in one more, one descriptor long.
    tag_reads = [segs for segs in posted if sum(s.length for s in segs) < 4096]
    assert len(tag_reads) == 1 and len(tag_reads[0]) == 1, posted
    blocks = n // pnode.store.block_size
    assert tag_reads[0][0].length == 8 * (3 * blocks + 1)  # a's tag to d's
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == 4 and counters["tag_reads"] == 1
    assert counters["direct_reads_stale"] == 1 and counters["requests"] == 1
    assert consumer.tag_reads_held() == 0
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


def test_more_tags_in_a_pass_than_one_read_takes_come_back_in_several_reads(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """More located entries in one fetch than one READ of tags takes (here 2, for
    the test): their tags come back in as many READs as it takes, each checked
    against its own entry's, and every entry lands whole."""
    monkeypatch.setattr("ecshare.peer.pull.TAGS_PER_READ", 2)
    pnode, producer = make_producer(keyring.producer_config(), CMA)
    cnode, consumer = make_consumer(keyring.consumer_config(), CMA, NIXL_TAGS)
    _up(consumer, producer.address)
    names, n = [f"t{i}" for i in range(5)], MiB + 8
    for h in names:
        pnode.store.put(h, expected(h, n))
    _located(consumer, len(names))

    results = [f.result(timeout=10) for f in consumer.fetch(names, [producer.address])]

    assert [r.attempts for r in results] == [0] * len(names)
    for h in names:
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n), err_msg=h)
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == len(names) and counters["tag_reads"] == 3
    assert "direct_reads_stale" not in counters and consumer.tag_reads_held() == 0
    cnode.store.check_invariants()


def test_a_full_landing_sends_direct_reads_to_the_producer_for_a_grant(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """Every chunk of the landing is held (as by READs of tags that never end): a
    direct read's bytes land, its tag cannot be read back, and the fetch asks the
    producer instead; once chunks are free again, tags are read as ever."""
    pnode, producer = make_producer(keyring.producer_config(), CMA)
    cnode, consumer = make_consumer(keyring.consumer_config(), CMA, NIXL_TAGS)
    _up(consumer, producer.address)
    n = 2 * MiB
    pnode.store.put("h", expected("h", n))
    pnode.store.put("g", expected("g", n))
    _located(consumer, 2)
    landing = consumer._landing
    assert landing is not None
    # Every chunk taken, as by READs of tags that never end (the consumer's thread
    # sleeps meanwhile: nothing else takes or gives back).
    held = [landing.take([0]) for _ in range(landing.chunks)]
    assert landing.take([0]) is None and consumer.tag_reads_held() == landing.chunks

    result = consumer.fetch(["h"], [producer.address])[0].result(timeout=10)

    assert result.attempts == 1  # granted
    np.testing.assert_array_equal(stored_bytes(cnode, "h"), expected("h", n))
    counters = consumer.counter_snapshot()
    assert counters["direct_reads"] == 1 and counters["tag_landing_full"] == 1
    assert "tag_reads" not in counters
    for read in held:
        assert read is not None
        landing.give_back(read)
    assert consumer.fetch(["g"], [producer.address])[0].result(timeout=10).attempts == 0
    np.testing.assert_array_equal(stored_bytes(cnode, "g"), expected("g", n))
    assert consumer.counter_snapshot()["tag_reads"] == 1
    assert cnode.store.stats().canary_violations == 0
    cnode.store.check_invariants()


# -- the producer's side ---------------------------------------------------------------------


@pytest.fixture
def region() -> Iterator[Region]:
    with Region.create(64 * MiB, name="ecshare-test-locator") as r:
        yield r


def test_locator_takes_each_digest_under_a_pin_and_skips_what_is_gone(region: Region) -> None:
    store = Store(region, 64 * 1024)
    wakes: list[int] = []
    locator = Locator(store, lambda: wakes.append(1))
    locator.start()
    store.put("quiet", np.zeros(10, dtype=np.uint8))  # nobody listens yet: not queued
    assert not locator.pending
    locator.listening = True
    a = store.put("a", expected("a", 70_000))
    store.put("b", expected("b", 5), checksum=True)  # the engine's digest is taken as is
    store.put("gone", expected("gone", 10))
    store.remove("gone")
    assert wakes == [1]  # one wake-up for the queue that was empty

    [batch] = locator.take()

    assert [x.mm_hash for x in batch] == ["a", "b"]
    assert batch[0].checksum == xxhash.xxh3_64_intdigest(expected("a", 70_000).tobytes())
    assert [(e.offset, e.length) for e in batch[0].extents] == list(a.extents)
    assert (batch[0].nbytes, batch[0].dtype, batch[0].shape) == (70_000, "uint8", [70_000])
    assert batch[1].checksum == xxhash.xxh3_64_intdigest(expected("b", 5).tobytes())
    assert (locator.located, locator.digests, locator.gone) == (2, 1, 1)
    assert store.stats().pins == 0
    locator.stop()
    store.put("after", np.zeros(10, dtype=np.uint8))
    assert not locator.pending


def test_locator_splits_what_one_frame_cannot_hold(region: Region) -> None:
    store = Store(region, 4096)
    locator = Locator(store, lambda: None)
    locator.start()
    locator.listening = True
    for i in range(5000):
        store.allocate(f"e{i}", 1, EntryMeta(dtype="uint8", shape=(1,)))
        store.commit(store.get(f"e{i}"))  # type: ignore[arg-type]

    batches = locator.take()

    assert sum(len(b) for b in batches) == 5000 and len(batches) >= 2
    codec = p.Codec()
    for batch in batches:
        assert len(batch) <= p.MAX_BATCH_ITEMS
        codec.encode(p.Located(session_id="s", entries=batch))  # within the frame limit


def test_located_entries_reach_only_sessions_that_read_directly(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    pnode, producer = make_producer(keyring.producer_config(), CMA)
    _, direct = make_consumer(keyring.consumer_config(), CMA)
    _, granted = make_consumer(keyring.consumer_config(), CMA, {"direct_reads": False})
    _up(direct, producer.address)
    _up(granted, producer.address)
    pnode.store.put("h", expected("h", 4096))

    _located(direct, 1)
    assert stays(lambda: "locations_heard" not in granted.counter_snapshot(), granted)
    assert _sent(producer) == 1


def _sent(producer: Producer) -> int:
    return dict(producer.counters).get("located_sent", 0)
