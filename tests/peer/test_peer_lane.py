"""The fetch lane (ecshare/control/lane.py): fetches take it, and nothing about it can
make a fetch fail that ZMQ would have served.

Real parts throughout: ZMQ with CURVE and the lane's TCP sockets on 127.0.0.1;
producers and consumers on `LoopbackTransport` in this process for the logic (see
loopback_testing.py), and a producer process over real NIXL for the bytes. A lane
is cut the way a network cuts it: the producer's end of its TCP connection is shut
down under it.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Callable

import numpy as np
import pytest
from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from peer_testing import Keyring, MakeConsumer, SpawnProducer, expected, stored_bytes
from waiting import wait_until

from ecshare.peer import Node, Producer
from ecshare.vllm.servers import free_port

pytestmark = pytest.mark.timeout(60)


def cut_lanes(port: int) -> int:
    """Shut down every accepted connection of this process on `port` (the producer's
    ends of its lanes), as a reset would; how many."""
    cut = 0
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if (
                sock.family in (socket.AF_INET, socket.AF_INET6)  # not a Unix socket: no port
                and sock.type == socket.SOCK_STREAM
                and sock.getsockname()[1] == port
            ):
                sock.getpeername()  # the listener has none: skipped
                sock.shutdown(socket.SHUT_RDWR)
                cut += 1
        except OSError:
            pass
        finally:
            sock.close()
    return cut


def lane_stats(producer: Producer) -> dict[str, int]:
    return {k: v for k, v in producer.control_stats.items() if k.startswith("lane_")}


def test_a_fetch_takes_the_lane_and_is_byte_exact(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    _pnode, producer = loop_producer(keyring.producer_config(), entries={"a": 100003, "b": 7})
    node, consumer = loop_consumer(keyring.consumer_config())

    consumer.fetch(["a"], [producer.address])[0].result(timeout=10)
    wait_until(lambda: lane_stats(producer)["lane_bound"] == 1, timeout_s=5)
    consumer.fetch(["b"], [producer.address])[0].result(timeout=10)

    np.testing.assert_array_equal(stored_bytes(node, "a"), expected("a", 100003))
    np.testing.assert_array_equal(stored_bytes(node, "b"), expected("b", 7))
    assert consumer.counters["lanes_opened"] == 1
    assert consumer.counters["lane_requests"] >= 1
    wait_until(lambda: lane_stats(producer)["lane_received"] >= 1, timeout_s=5)
    assert not any(k.startswith("lanes_lost.") for k in consumer.counters)


@pytest.mark.parametrize("ucx_tls", ["cma", "tcp"], ids=["one_host", "ucx_tcp"])
def test_a_fetch_over_the_lane_is_byte_exact_across_processes(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring, ucx_tls: str
) -> None:
    data_plane = {"ucx_tls": "tcp"} if ucx_tls == "tcp" else {}
    sizes = "65536:1,1MiB:1,4505600:1"
    producer = spawn_producer(
        synthetic=sizes, config={**keyring.producer_config(), **data_plane}, hooks=True
    )
    node, consumer = make_consumer(keyring.consumer_config(), data_plane)
    consumer.connect([producer.address])
    wait_until(lambda: producer.stats()["control"]["lane_bound"] == 1, timeout_s=10)

    for h, nbytes in producer.sizes.items():  # one at a time: each its own request
        result = consumer.fetch([h], [producer.address])[0].result(timeout=15)
        assert result.nbytes == nbytes
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes), err_msg=h)

    assert consumer.counters["lane_requests"] == len(producer.sizes)
    stats = producer.stats()
    # Every request came by the lane (ZMQ carried the Hello and the heartbeats).
    assert stats["counters"]["fetch_requests"] == len(producer.sizes)
    assert stats["control"]["lane_received"] >= len(producer.sizes)
    wait_until(lambda: producer.stats()["store"]["pins"] == 0, timeout_s=5.0)


def test_a_lane_cut_mid_request_still_fetches_over_zmq(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    pnode, producer = loop_producer(keyring.producer_config(), entries={"warm": 10, "x": 300001})
    node, consumer = loop_consumer(keyring.consumer_config())
    consumer.fetch(["warm"], [producer.address])[0].result(timeout=10)
    wait_until(lambda: lane_stats(producer)["lane_bound"] == 1, timeout_s=5)
    port = producer.lane_port
    assert port is not None
    cut_in_grant(pnode, lambda: cut_lanes(port))

    result = consumer.fetch(["x"], [producer.address])[0].result(timeout=10)

    assert result.nbytes == 300001
    np.testing.assert_array_equal(stored_bytes(node, "x"), expected("x", 300001))
    assert consumer.counters["lane_resent"] == 1
    assert sum(n for k, n in consumer.counters.items() if k.startswith("lanes_lost.")) == 1
    # Sent again with its id: answered from the reply cache, pinned once.
    assert producer.counters["duplicate_requests"] == 1
    assert producer.counters["granted"] == 2
    wait_until(lambda: pnode.store.stats().pins == 0, timeout_s=5)


def cut_in_grant(node: Node, cut: Callable[[], int]) -> None:
    """The first grant's pin runs `cut` first, on the producer's thread: the request
    has come, its answer has not gone."""
    pin = node.store.pin
    done = threading.Event()

    def pin_then_cut(*args: object, **kwargs: object) -> object:
        if not done.is_set() and str(args[0]) != "warm":
            done.set()
            assert cut() == 1
        return pin(*args, **kwargs)  # type: ignore[arg-type]

    node.store.pin = pin_then_cut  # type: ignore[method-assign]


def test_after_a_lost_lane_the_session_goes_on_over_zmq(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    entries = {f"h{i}": 1000 + i for i in range(4)}
    _pnode, producer = loop_producer(keyring.producer_config(), entries=entries)
    node, consumer = loop_consumer(keyring.consumer_config())
    consumer.fetch(["h0"], [producer.address])[0].result(timeout=10)
    wait_until(lambda: lane_stats(producer)["lane_bound"] == 1, timeout_s=5)
    port = producer.lane_port
    assert port is not None

    assert cut_lanes(port) == 1
    wait_until(lambda: any(k.startswith("lanes_lost.") for k in consumer.counters), timeout_s=5)
    on_lane = consumer.counters["lane_requests"]
    for h in ("h1", "h2", "h3"):
        consumer.fetch([h], [producer.address])[0].result(timeout=10)
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, entries[h]))

    assert consumer.counters["lane_requests"] == on_lane
    assert producer.session_count() == 1  # the same session, on ZMQ
    assert consumer.counters["lanes_opened"] == 1


@pytest.mark.parametrize("off", ["producer", "consumer"])
def test_with_the_lane_off_everything_goes_over_zmq(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring, off: str
) -> None:
    lane_off = {"fetch_lane": False}
    _pnode, producer = loop_producer(
        keyring.producer_config(), lane_off if off == "producer" else {}, entries={"a": 5000}
    )
    node, consumer = loop_consumer(keyring.consumer_config(), lane_off if off == "consumer" else {})

    consumer.fetch(["a"], [producer.address])[0].result(timeout=10)

    np.testing.assert_array_equal(stored_bytes(node, "a"), expected("a", 5000))
    assert consumer.counters["lanes_opened"] == 0
    assert consumer.counters["lane_requests"] == 0
    assert (producer.lane_port is None) == (off == "producer")
    assert lane_stats(producer).get("lane_accepted", 0) == 0


@pytest.mark.parametrize(
    ("payload", "counter"),
    [
        (b"", "lane_dropped_bind_timeout"),
        (b"GET / HTTP/1.1\r\n\r\n", "lane_dropped_handshake"),
        # A bind frame of the lane's earlier wire (no TLS), for a made-up session.
        (
            b"\x00\x00\x00\x39" + bytes([32]) + b"0" * 32 + b"\x00" * 24,
            "lane_dropped_handshake",
        ),
    ],
    ids=["silent", "garbage", "bind_without_tls"],
)
def test_a_stranger_on_the_lane_port_learns_nothing_and_sessions_keep_serving(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    keyring: Keyring,
    payload: bytes,
    counter: str,
) -> None:
    _pnode, producer = loop_producer(
        keyring.producer_config(), {"handshake_timeout_s": 0.5}, entries={"a": 4000, "b": 9}
    )
    node, consumer = loop_consumer(keyring.consumer_config())
    consumer.fetch(["a"], [producer.address])[0].result(timeout=10)
    assert producer.lane_port is not None

    stranger = socket.create_connection(("127.0.0.1", producer.lane_port), timeout=5)
    stranger.sendall(payload)

    assert stranger.recv(4096) == b""  # closed, and not one byte sent before
    stranger.close()
    wait_until(
        lambda: lane_stats(producer)[counter] == 1, timeout_s=5, detail=lambda: lane_stats(producer)
    )
    consumer.fetch(["b"], [producer.address])[0].result(timeout=10)
    np.testing.assert_array_equal(stored_bytes(node, "b"), expected("b", 9))
    assert producer.healthy
    assert not any(k.startswith("lanes_lost.") for k in consumer.counters)


def test_a_fetch_on_an_idle_lane_goes_out_from_the_callers_thread(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    entries = {f"i{n}": 2000 + n for n in range(5)}
    _pnode, producer = loop_producer(keyring.producer_config(), entries=entries)
    node, consumer = loop_consumer(keyring.consumer_config())
    consumer.fetch(["i0"], [producer.address])[0].result(timeout=10)
    wait_until(lambda: lane_stats(producer)["lane_bound"] == 1, timeout_s=5)

    for h in ("i1", "i2", "i3", "i4"):
        wait_until(lambda: consumer.pending() == 0, timeout_s=5)
        consumer.fetch([h], [producer.address])[0].result(timeout=10)
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, entries[h]))

    # The network thread sleeps between fetches: most requests skip the hand-off.
    assert consumer.counters["requests_sent_by_caller"] >= 2
    assert consumer.counters["lane_requests"] == 4


def test_a_fetch_sent_at_once_on_a_cut_lane_still_succeeds(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    entries = {f"c{n}": 3000 + n for n in range(4)}
    _pnode, producer = loop_producer(keyring.producer_config(), entries=entries)
    node, consumer = loop_consumer(keyring.consumer_config())
    consumer.fetch(["c0"], [producer.address])[0].result(timeout=10)
    wait_until(lambda: lane_stats(producer)["lane_bound"] == 1, timeout_s=5)
    port = producer.lane_port
    assert port is not None

    assert cut_lanes(port) == 1
    futures = [consumer.fetch([h], [producer.address])[0] for h in ("c1", "c2", "c3")]

    for future, h in zip(futures, ("c1", "c2", "c3"), strict=True):
        assert future.result(timeout=10).nbytes == entries[h]
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, entries[h]))
    assert sum(n for k, n in consumer.counters.items() if k.startswith("lanes_lost.")) == 1
    wait_until(lambda: producer.active_grants() == 0, timeout_s=5)


def test_a_configured_lane_port_is_the_one_consumers_use(
    loop_producer: MakeLoopProducer, loop_consumer: MakeLoopConsumer, keyring: Keyring
) -> None:
    port = free_port()
    _pnode, producer = loop_producer(
        keyring.producer_config(), {"lane_port": port}, entries={"a": 3000}
    )
    node, consumer = loop_consumer(keyring.consumer_config())

    assert producer.lane_port == port
    consumer.connect([producer.address])
    wait_until(lambda: lane_stats(producer)["lane_bound"] == 1, timeout_s=5)
    consumer.fetch(["a"], [producer.address])[0].result(timeout=10)
    np.testing.assert_array_equal(stored_bytes(node, "a"), expected("a", 3000))
    assert consumer.counters["lane_requests"] == 1


def test_a_taken_lane_port_fails_the_producers_start_naming_it(
    loop_producer: MakeLoopProducer, keyring: Keyring
) -> None:
    from ecshare.control import ControlConfigError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(ControlConfigError, match=f"port {port} \\(lane_port\\)"):
            loop_producer(keyring.producer_config(), {"lane_port": port})
