"""A live producer process takes hostile frames and stays whole.

The fuzzing client is an authorized CURVE peer, because an unauthorized one never
gets past the handshake; a second part sends garbage at the raw TCP port without
CURVE. After each, the producer must be alive, unchanged (sessions, grants, entries,
pins), have counted every frame, hold its memory, and serve a real fetch byte-exact.
"""

from __future__ import annotations

import random
import select
import socket
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest
import zmq

pytest.importorskip("nixl._api")

from fuzz_frames import FrameFuzzer, classify
from peer_testing import (
    Keyring,
    MakeConsumer,
    MakeRawSession,
    ProducerProcess,
    SpawnProducer,
    expected,
    granted,
    stored_bytes,
)
from security_testing import (
    curve_dealer,
    host_port,
    parse_zmtp,
    producer_state,
    rss_bytes,
)
from waiting import wait_until

from ecshare import protocol as p
from ecshare.control import CONSUMER_TO_PRODUCER

pytestmark = pytest.mark.timeout(180)

LIVE_FRAMES = 100_000
RAW_CONNECTIONS = 400
# Growth of the producer's resident memory a fuzz run may cause: buffers and
# interpreter caches, not anything that scales with the number of frames.
RSS_BOUND = 32 << 20
# Leases and session liveness far beyond the run, so that nothing ends by itself.
STEADY = {"grant_lease_s": 600.0, "heartbeat_timeout_s": 60.0}


def _delta(after: dict[str, int], before: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


def _check_serves(producer: ProducerProcess, make_consumer: MakeConsumer, keyring: Keyring) -> None:
    assert producer.process.poll() is None, producer.stderr()
    node, consumer = make_consumer(keyring.consumer_config())
    for h, nbytes in producer.sizes.items():
        result = consumer.fetch([h], [producer.address])[0].result(timeout=20)
        assert result.nbytes == nbytes
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes))


def test_authorized_fuzzer_changes_nothing_and_every_frame_is_counted(
    spawn_producer: SpawnProducer,
    make_consumer: MakeConsumer,
    raw_session: MakeRawSession,
    keyring: Keyring,
) -> None:
    producer = spawn_producer(
        synthetic="64KiB:2,1MiB:1", config={**keyring.producer_config(), **STEADY}, hooks=True
    )
    first = next(iter(producer.sizes))
    # An honest session holding a grant: the state the fuzzer must leave alone.
    honest = raw_session(producer.address)
    assert isinstance(honest.hello(), p.Welcome)
    grant = granted(honest.fetch("r-honest", first))
    before = producer.stats()
    rss_before = rss_bytes(producer.process.pid)

    codec = p.Codec()
    sent: Counter[str] = Counter()
    honest_messages = 0
    context: zmq.Context[Any] = zmq.Context()
    dealer = curve_dealer(
        context, producer.address, server_public=keyring.producer.public, client=keyring.consumer
    )
    replies = 0
    started = time.monotonic()
    try:
        frames = iter(FrameFuzzer(seed=7_000_001))
        rng = random.Random(7)
        for index in range(LIVE_FRAMES):
            if index % 97 == 0:
                # A message of 0, 2 or 3 frames where one is expected.
                parts = [next(frames)[1] for _ in range(rng.choice((2, 3)))]
                dealer.send_multipart(parts)
                sent["frame_count"] += 1
            else:
                _, frame = next(frames)
                dealer.send(frame)
                sent[classify(codec, frame, CONSUMER_TO_PRODUCER)] += 1
            if index % 1000 == 0:
                while dealer.poll(0):  # answers: read and thrown away, in batches
                    dealer.recv()
                    replies += 1
                honest.heartbeat()
                honest_messages += 1
        expected_drops = sent["malformed"] + sent["unexpected_kind"] + sent["frame_count"]

        def all_counted() -> bool:
            honest.heartbeat()
            control = producer.stats()["control"]
            drops = sum(_delta(control, before["control"], f"dropped_{k}") for k in sent)
            return drops >= expected_drops and _delta(control, before["control"], "received") >= (
                sent["valid"] + honest_messages
            )

        wait_until(
            all_counted,
            timeout_s=60.0,
            interval_s=0.2,
            detail=lambda: (sent, producer.stats()["control"]),
        )
        while dealer.poll(200):
            dealer.recv()
            replies += 1
    finally:
        dealer.close(linger=0)
        context.term()
    elapsed = time.monotonic() - started

    after = producer.stats()
    rss_after = rss_bytes(producer.process.pid)
    control, counters = after["control"], after["counters"]
    print(
        f"live fuzz: {sum(sent.values())} frames in {elapsed:.1f} s "
        f"({dict(sent)}), {replies} answers; producer RSS {rss_before >> 20} MiB -> "
        f"{rss_after >> 20} MiB"
    )
    assert sum(sent.values()) == LIVE_FRAMES
    # Every invalid frame is a counted drop, of the right kind.
    for kind in ("malformed", "unexpected_kind", "frame_count"):
        assert _delta(control, before["control"], f"dropped_{kind}") == sent[kind], kind
    assert _delta(control, before["control"], "dropped_oversized") == 0
    # Valid frames naming no session of this key, the wrong fingerprint, or asking for
    # status without an admin key: each one refused and counted, none obeyed.
    refusals = sum(
        _delta(counters, before["counters"], k)
        for k in set(counters) | set(before["counters"])
        if k.startswith("refused_") or k == "no_session"
    )
    assert refusals == sent["valid"], (sent, counters)
    for key in ("granted", "sessions_opened", "sessions_closed", "released", "renewed"):
        assert _delta(counters, before["counters"], key) == 0, key
    # Nothing changed: the same sessions, grants, entries, pins and blocks.
    assert producer_state(after) == producer_state(before)
    assert after["grants"] == {honest.session_id: [grant.grant_id]}
    assert rss_after - rss_before < RSS_BOUND, (rss_before, rss_after)

    # The honest session is untouched: its grant renews and releases exactly once.
    renewed = honest.call(p.Renew(session_id=honest.session_id, grant_ids=[grant.grant_id]))
    assert isinstance(renewed, p.Renewed) and renewed.renewed == [grant.grant_id]
    released = honest.call(p.Release(session_id=honest.session_id, grant_ids=[grant.grant_id]))
    assert released == p.Released(released=[grant.grant_id])
    assert producer.stats()["store"]["pins"] == 0
    _check_serves(producer, make_consumer, keyring)


def _garbage(rng: random.Random) -> bytes:
    """What a port scanner or a confused client might send before any handshake."""
    null_greeting = b"\xff" + bytes(8) + b"\x7f\x03\x01NULL" + bytes(16) + b"\x00" + bytes(31)
    plain_ready = b"\x04\x19\x05READY\x0bSocket-Type\x00\x00\x00\x06DEALER"
    message = p.encode(p.Hello(versions=[2], session_id="x", client_name="x", fingerprint="x"))
    choice = rng.randrange(6)
    if choice == 0:
        return rng.randbytes(rng.choice((1, 10, 64, 512, 8192)))
    if choice == 1:  # a NULL-mechanism client that then sends a message in the clear
        return null_greeting + plain_ready + b"\x00" + bytes([len(message)]) + message
    if choice == 2:  # the greeting with a few bytes flipped
        greeting = bytearray(null_greeting + plain_ready)
        for _ in range(rng.randint(1, 4)):
            greeting[rng.randrange(len(greeting))] ^= 1 << rng.randrange(8)
        return bytes(greeting)
    if choice == 3:  # a CURVE greeting followed by a HELLO command of garbage
        curve = b"\xff" + bytes(8) + b"\x7f\x03\x00CURVE" + bytes(15) + b"\x00" + bytes(31)
        return curve + b"\x04\xc8\x05HELLO" + rng.randbytes(194)
    if choice == 4:  # HTTP, the commonest stranger
        return b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"
    return b"\xff" + bytes(8) + b"\x7f" + rng.randbytes(54)  # a greeting of noise


def test_raw_tcp_garbage_gets_nothing_but_a_handshake_refusal(
    spawn_producer: SpawnProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    producer = spawn_producer(synthetic="64KiB:1", config=keyring.producer_config(), hooks=True)
    before = producer.stats()
    rss_before = rss_bytes(producer.process.pid)
    rng = random.Random(11)
    secrets = [h.encode() for h in producer.sizes] + [b"welcome", b"agent", b"nixl"]
    received = 0
    for batch in range(RAW_CONNECTIONS // 100):
        conns: list[tuple[socket.socket, bytearray]] = []
        for _ in range(100):
            sock = socket.create_connection(host_port(producer.address), timeout=5)
            sock.sendall(_garbage(rng))
            sock.setblocking(False)
            conns.append((sock, bytearray()))
        open_socks = {sock: data for sock, data in conns}
        deadline = time.monotonic() + 2.0
        while open_socks and time.monotonic() < deadline:
            readable, _, _ = select.select(list(open_socks), [], [], 0.1)
            for sock in readable:
                try:
                    chunk = sock.recv(65536)
                except (ConnectionResetError, BlockingIOError):
                    chunk = b""
                if chunk:
                    open_socks[sock] += chunk
                else:
                    del open_socks[sock]
        for sock, data in conns:
            sock.close()
            received += len(data)
            # At most the producer's own greeting (mechanism CURVE) and an ERROR
            # command: no message frame, nothing about its entries or data plane.
            stream = parse_zmtp(bytes(data))
            assert stream.mechanism in (b"", b"CURVE"), (batch, data)
            assert stream.messages == 0, data
            assert set(stream.commands) <= {b"ERROR"}, data
            assert not any(s in data for s in secrets), data

    wait_until(
        lambda: (
            producer.stats()["control"]["handshake_failed_protocol"]
            + producer.stats()["control"]["handshake_failed_no_detail"]
            > before["control"]["handshake_failed_protocol"]
        ),
        timeout_s=10.0,
    )
    after = producer.stats()
    rss_after = rss_bytes(producer.process.pid)
    print(
        f"raw TCP garbage: {RAW_CONNECTIONS} connections, {received} bytes back; "
        f"producer RSS {rss_before >> 20} MiB -> {rss_after >> 20} MiB; control {after['control']}"
    )
    assert after["control"]["received"] == before["control"]["received"]
    assert after["control"]["auth_accepted"] == before["control"]["auth_accepted"]
    assert producer_state(after) == producer_state(before)
    assert rss_after - rss_before < RSS_BOUND
    _check_serves(producer, make_consumer, keyring)
