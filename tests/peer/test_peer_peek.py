"""Tags read straight from a producer's memory on this host (`tag_peek`).

A direct read keeps its bytes only if the entry's tag is still in place after
them. From a producer that runs on this host (its handshake tells the host's
boot ID and PID namespace, and its PID), the consumer reads that word with
a read of its ``/proc/<pid>/mem`` instead of a second NIXL READ. These tests use real
processes (a child holding a buffer, a producer process) and a real consumer:
the words come from another process's memory, a stale entry is still caught,
and anything that cannot be read that way (another host, a lying PID, a
producer gone) falls back to the NIXL READ of the tag, never to trusting the
bytes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator

import msgspec
import numpy as np
import pytest

pytest.importorskip("nixl._api")

from peer_testing import (
    FakeProducer,
    Keyring,
    MakeConsumer,
    MakeProducer,
    SpawnProducer,
    expected,
    stored_bytes,
)
from waiting import wait_until

from ecshare import protocol as p
from ecshare.apps.bench.synthetic import synthetic_bytes
from ecshare.peer import FailureReason, FetchFailed
from ecshare.peer.direct import PEEK_OVER_DIGEST
from ecshare.peer.peek import Peek, host_identity

pytestmark = pytest.mark.timeout(90)

MiB = 1 << 20

# A child that holds 16 KiB of known words (word i is 7 * i + 1) and prints where
# they lie.
_HOLDER = """
import ctypes, sys
buf = (ctypes.c_char * 16384)()
ctypes.memmove(buf, b"".join((7 * i + 1).to_bytes(8, "little") for i in range(2048)), 16384)
print(ctypes.addressof(buf), flush=True)
sys.stdin.read()
"""
HELD = 16384


@pytest.fixture
def holder() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        yield proc, int(proc.stdout.readline())
    finally:
        proc.kill()
        proc.wait(10)


def _announced(
    pid: int, address: int, size: int = HELD, host: str | None = None
) -> p.DataPlaneInfo:
    return p.DataPlaneInfo(
        kind="nixl",
        agent_name="a",
        region_address=address,
        region_size=size,
        host=host_identity() if host is None else host,
        pid=pid,
    )


def test_words_come_from_the_other_process_and_nothing_outside_its_region(
    holder: tuple[subprocess.Popen[str], int],
) -> None:
    proc, address = holder
    peek = Peek.open(_announced(proc.pid, address))
    assert peek is not None
    assert peek.words([0]) == [1]
    assert peek.words([56, 8, 0, 8]) == [50, 8, 1, 8]  # in the order asked
    # Far apart: a read per span of them, each word where it lies.
    assert peek.words([HELD - 8, 0, 8192]) == [7 * 2047 + 1, 1, 7 * 1024 + 1]
    for bad in ([4], [HELD], [-8], [0, HELD - 4], []):  # unaligned, past, before, none
        assert peek.words(bad) is None, bad
    proc.kill()
    proc.wait(10)
    assert peek.words([0]) is None  # gone: the caller reads over NIXL instead


def test_a_reader_is_opened_only_for_a_readable_region_on_this_host(
    holder: tuple[subprocess.Popen[str], int],
) -> None:
    proc, address = holder
    assert host_identity()  # Linux: a boot ID and a PID namespace
    assert Peek.open(_announced(proc.pid, address)) is not None
    assert Peek.open(_announced(proc.pid, address, host="")) is None  # not told
    assert Peek.open(_announced(proc.pid, address, host="other-boot/pid:[1]")) is None
    assert Peek.open(_announced(0, address)) is None
    assert Peek.open(_announced(proc.pid, 0)) is None
    assert Peek.open(_announced(proc.pid, address, size=4)) is None  # not even a word
    # The child's PID with an address where nothing is mapped in it: the first read
    # fails, so no reader.
    assert Peek.open(_announced(proc.pid, 4096)) is None


def test_a_producer_process_has_its_tags_read_from_its_memory_and_a_stale_one_caught(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """A producer in its own process: an entry of 4 MiB is read directly and its tag
    read from the producer's memory (no READ of tags); then an entry evicted before
    its fetch is caught by its tag all the same, and the producer is asked."""
    producer = spawn_producer(synthetic="", config=keyring.producer_config(), hooks=True)
    cnode, consumer = make_consumer(keyring.consumer_config())
    consumer.connect([producer.address])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=10.0)
    assert consumer._links[producer.address].peek is not None
    heard = consumer.counter_snapshot().get("locations_heard", 0)
    assert producer.command("put fresh 4194304") == {"put": "fresh"}
    assert producer.command("put old 4194304") == {"put": "old"}
    wait_until(
        lambda: consumer.counter_snapshot().get("locations_heard", 0) >= heard + 2, timeout_s=5.0
    )

    result = consumer.fetch(["fresh"], [producer.address])[0].result(timeout=10)
    assert result.attempts == 0  # read directly
    np.testing.assert_array_equal(stored_bytes(cnode, "fresh"), synthetic_bytes("fresh", 4 * MiB))
    counters = consumer.counter_snapshot()
    assert counters["tag_peeks"] == 1 and "tag_reads" not in counters, counters

    assert producer.command("remove old") == {"removed": "old"}
    assert producer.command("put new 4194304") == {"put": "new"}  # into old's blocks
    with pytest.raises(FetchFailed) as failed:
        consumer.fetch(["old"], [producer.address])[0].result(timeout=10)
    assert failed.value.reason is FailureReason.MISSING
    counters = consumer.counter_snapshot()
    assert counters["tag_peeks"] == 2 and counters["direct_reads_stale"] == 1, counters
    assert counters["requests"] == 1 and "tag_reads" not in counters
    assert cnode.store.get("old") is None
    cnode.store.check_invariants()
    peek = consumer._links[producer.address].peek
    assert peek is not None
    consumer.stop()  # the session ends: its reader's descriptor is closed
    assert peek.words([0]) is None


def test_a_read_that_fails_mid_session_falls_back_to_the_nixl_read_of_the_tag(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    holder: tuple[subprocess.Popen[str], int],
) -> None:
    """The producer's memory stops being readable (here: the reader points at a
    process that then exits): the tag is READ over NIXL instead, the fetch is kept
    whole, and the session reads its tags that way from then on."""
    pnode, producer = make_producer(keyring.producer_config())
    cnode, consumer = make_consumer(keyring.consumer_config())
    consumer.connect([producer.address])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=10.0)
    link = consumer._links[producer.address]
    assert link.peek is not None
    proc, address = holder
    link.peek.close()
    link.peek = Peek.open(_announced(proc.pid, address))  # then that process ends
    assert link.peek is not None
    proc.kill()
    proc.wait(10)
    for h in ("a", "b"):
        pnode.store.put(h, expected(h, 2 * MiB))
    wait_until(lambda: consumer.counter_snapshot().get("locations_heard", 0) >= 2, timeout_s=5.0)

    for h in ("a", "b"):
        assert consumer.fetch([h], [producer.address])[0].result(timeout=10).attempts == 0
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, 2 * MiB))

    counters = consumer.counter_snapshot()
    assert counters["tag_peeks_failed"] == 1 and counters["tag_reads"] == 2, counters
    assert "tag_peeks" not in counters and "direct_reads_stale" not in counters
    assert link.peek is None
    cnode.store.check_invariants()


@pytest.mark.parametrize("lie", ["pid", "host"])
def test_a_producer_that_tells_another_process_gets_its_tags_read_over_nixl(
    fake_producer: FakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    holder: tuple[subprocess.Popen[str], int],
    lie: str,
) -> None:
    """A producer whose handshake names a process where its region does not lie (or
    another host): no reader is opened, and a direct read's tag is READ over NIXL,
    which catches a tag out of place as ever."""
    fake = fake_producer
    proc, _ = holder
    fake.announce = {"pid": proc.pid} if lie == "pid" else {"host": "elsewhere/pid:[1]"}
    n = MiB - 4096
    word = (1 << 20) - 8
    fake.mm[:n] = expected("t", n).tobytes()
    fake.mm[word:] = (41).to_bytes(8, "little")
    cnode, consumer = make_consumer(keyring.consumer_config())
    consumer.connect([fake.address])
    hello: p.Hello = fake.recv(p.Hello)
    fake.welcome(hello, [p.CAP_READ_DIRECT, p.CAP_CHECKSUM_XXH3_64])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=5.0)
    wait_until(lambda: not consumer._reads.warming, timeout_s=5.0)
    assert consumer._links[fake.address].peek is None
    where = p.Location(
        mm_hash="t",
        extents=[p.Extent(0, n)],
        nbytes=n,
        dtype="uint8",
        shape=[n],
        tag=42,
        tag_offset=word,
    )
    fake.server.send(fake.route, p.Located(session_id=fake.session_id, entries=[where]))
    wait_until(lambda: consumer.counter_snapshot().get("locations_heard", 0) == 1, timeout_s=5.0)

    future = consumer.fetch(["t"], [fake.address])[0]
    request: p.FetchRequest = fake.recv(p.FetchRequest)  # the tag was 41: asked for

    counters = consumer.counter_snapshot()
    assert counters["tag_reads"] == 1 and counters["direct_reads_stale"] == 1, counters
    assert "tag_peeks" not in counters and "tag_peeks_failed" not in counters
    reply = p.ItemReply(mm_hash="t", status=p.ItemStatus.MISSING)
    fake.server.send(fake.route, p.FetchReply(request_id=request.request_id, items=[reply]))
    with pytest.raises(FetchFailed):
        future.result(timeout=10)
    assert cnode.store.get("t") is None


def test_the_handshake_field_is_bounded() -> None:
    """A host string past its bound, or a negative PID, is refused at decoding."""
    good = msgspec.json.encode(_announced(1, 4096))
    assert msgspec.json.decode(good, type=p.DataPlaneInfo).pid == 1
    for bad in ({"host": "x" * 129}, {"pid": -1}, {"pid": 1 << 31}):
        raw = msgspec.json.encode(msgspec.structs.replace(_announced(1, 4096), **bad))
        with pytest.raises(msgspec.ValidationError):
            msgspec.json.decode(raw, type=p.DataPlaneInfo)


def test_a_lone_small_entry_is_checked_by_its_digest_and_a_larger_one_by_its_tag(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """Up to `PEEK_OVER_DIGEST`, a lone entry's digest is cheaper than reading its tag
    even from the producer's memory; over it (and up to DIGEST_MAX, where the
    producer sends a digest too), the tag is read that way instead."""
    pnode, producer = make_producer(keyring.producer_config())
    cnode, consumer = make_consumer(keyring.consumer_config())
    consumer.connect([producer.address])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=10.0)
    assert consumer._links[producer.address].peek is not None
    sizes = {"small": PEEK_OVER_DIGEST, "larger": PEEK_OVER_DIGEST + 8}
    for h, n in sizes.items():
        pnode.store.put(h, expected(h, n))
    wait_until(lambda: consumer.counter_snapshot().get("locations_heard", 0) >= 2, timeout_s=5.0)

    for h, n in sizes.items():
        assert consumer.fetch([h], [producer.address])[0].result(timeout=10).attempts == 0
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, n))
        peeks = consumer.counter_snapshot().get("tag_peeks", 0)
        assert peeks == (0 if h == "small" else 1), (h, peeks)
    assert "tag_reads" not in consumer.counter_snapshot()


@pytest.mark.parametrize("tag_peek", [True, False])
def test_a_fresh_session_to_a_producer_on_this_host_lends_from_its_first_fetch(
    make_producer: MakeProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
    tag_peek: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A producer whose memory this process reads is on this host, so its READs end
    inside the read call (cross-memory attach): a caller blocking on the first
    fetches of a session, 64 KiB each, makes their READs on its own thread. Without
    that reader, nothing is lent until a READ of a MiB has ended inside the call."""
    pnode, producer = make_producer(keyring.producer_config())
    cnode, consumer = make_consumer(keyring.consumer_config(), {"tag_peek": tag_peek})
    consumer.connect([producer.address])
    wait_until(lambda: [x.up for x in consumer.peer_liveness()] == [True], timeout_s=10.0)
    wait_until(lambda: not consumer._reads.warming, timeout_s=5.0)
    link = consumer._links[producer.address]
    assert (link.peek is not None) is tag_peek
    assert link.copies_in_call is tag_peek  # before any fetch
    names = [f"small-{i}" for i in range(4)]  # no READ of a MiB, ever
    for h in names:
        pnode.store.put(h, expected(h, 64 << 10))
    wait_until(lambda: consumer.counter_snapshot().get("locations_heard", 0) >= 4, timeout_s=5.0)
    # The network thread left unwoken, so that the caller is first to the lock (it may
    # still wake for a timer of its own: the race of the two is test_peer_direct.py's).
    assert consumer._waker is not None
    monkeypatch.setattr(consumer._waker, "wake", lambda: None)

    for h in names:
        result = consumer.fetch([h], [producer.address])[0].result(timeout=10)
        assert result.attempts == 0
        np.testing.assert_array_equal(stored_bytes(cnode, h), expected(h, 64 << 10))

    lent = consumer.counter_snapshot().get("read_lent", 0)
    assert lent >= len(names) - 1 if tag_peek else lent == 0, consumer.counter_snapshot()
