"""An on-path observer of the fetch lane: what it records opens nothing when replayed,
and no (key, nonce) pair is ever sealed twice, across reconnects and both directions.

The observer is a real TCP relay on 127.0.0.2 in front of a producer on 127.0.0.1:
the consumer is told the relay's address, so its ZMQ CURVE session and its lane
(whose port the Welcome names; the relay listens on that port at its own address)
both cross it, and the relay keeps every byte of the lane each way. Producer and
consumer are the real ones, with NIXL.

The nonces are read off the wire, not from inside the code: each connection's TLS
secrets come from the standard SSLKEYLOGFILE seam (OpenSSL's key log), the
record keys and IVs are derived from them as RFC 8446 section 7 says, and every
record the relay saw is opened with `cryptography` under the (key, nonce) the
record layer must have used: a record that opens under no expected pair fails
the test, and so does any pair seen twice.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305
from cryptography.hazmat.primitives.kdf.hkdf import HKDFExpand
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from peer_testing import Keyring, MakeConsumer, MakeProducer, expected, stored_bytes
from waiting import wait_until

from ecshare import protocol as p
from ecshare.control import LaneClient, LaneServer

pytestmark = pytest.mark.timeout(120)

OBSERVER_HOST = "127.0.0.2"


@dataclass
class Recorded:
    """One connection through the relay: the bytes each way, in order."""

    up: bytearray = field(default_factory=bytearray)  # client to server
    down: bytearray = field(default_factory=bytearray)  # server to client
    done: threading.Event = field(default_factory=threading.Event)


class Relay:
    """A TCP forwarder from (OBSERVER_HOST, port) to (target, port) that keeps
    every byte of every connection it carries."""

    def __init__(self, target: tuple[str, int], port: int | None = None) -> None:
        self.target = target
        self._listener = socket.create_server((OBSERVER_HOST, target[1] if port is None else port))
        self.port: int = self._listener.getsockname()[1]
        self.connections: list[Recorded] = []
        self._socks: list[socket.socket] = []
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self.target)
            except OSError:  # the far end is gone: so is this connection
                client.close()
                continue
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            record = Recorded()
            self.connections.append(record)
            self._socks += [client, server]
            ends = [threading.Event(), threading.Event()]
            for src, dst, log, end in (
                (client, server, record.up, ends[0]),
                (server, client, record.down, ends[1]),
            ):
                threading.Thread(target=self._pump, args=(src, dst, log, end), daemon=True).start()
            threading.Thread(
                target=lambda e=ends, r=record: [x.wait() for x in e] and r.done.set(),
                daemon=True,
            ).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, log: bytearray, end: threading.Event) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                log += data
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)
        end.set()

    def close(self) -> None:
        self._stop = True
        self._listener.close()
        for sock in self._socks:
            sock.close()


# -- the replay, against a real consumer and producer -------------------------------------------


def lane_stats(stats: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in stats.items() if k.startswith("lane_")}


def replay(port: int, recorded: bytes) -> bytes:
    """Send `recorded` on a new connection to the producer's lane; what came back."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    back = b""
    with contextlib.suppress(OSError):
        sock.sendall(recorded)
        while data := sock.recv(65536):
            back += data
    sock.close()
    return back


def records(stream: bytes) -> Iterator[tuple[int, bytes, bytes]]:
    """The TLS records of a byte stream: (content type, header, body)."""
    at = 0
    while at + 5 <= len(stream):
        length = int.from_bytes(stream[at + 3 : at + 5], "big")
        yield stream[at], stream[at : at + 5], stream[at + 5 : at + 5 + length]
        at += 5 + length


def test_a_replayed_lane_opens_nothing_and_the_live_lane_keeps_serving(
    make_producer: MakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    _pnode, producer = make_producer(keyring.producer_config(), entries={"a": 70001, "b": 9})
    assert producer.lane_port is not None
    control = Relay(("127.0.0.1", producer.port), port=0)
    lane = Relay(("127.0.0.1", producer.lane_port))
    try:
        node, consumer = make_consumer(keyring.consumer_config())
        via_observer = f"tcp://{OBSERVER_HOST}:{control.port}"
        consumer.connect([via_observer])
        wait_until(lambda: lane_stats(producer.control_stats).get("lane_bound") == 1, timeout_s=10)
        consumer.fetch(["a"], [via_observer])[0].result(timeout=10)
        np.testing.assert_array_equal(stored_bytes(node, "a"), expected("a", 70001))
        assert consumer.counters["lane_requests"] == 1
        (live,) = lane.connections
        wait_until(lambda: producer.counters["fetch_requests"] == 1, timeout_s=5)
        wait_until(lambda: producer.active_grants() == 0, timeout_s=5)  # the Release is in
        up = bytes(live.up)  # the handshake, the bind, the request, the Release
        first_records = [h + b for _, h, b in records(up)]
        assert len(first_records) >= 4  # ClientHello, ChangeCipherSpec, Finished, bind...
        before = dict(producer.control_stats)
        served_before = producer.counters["fetch_requests"]

        # All the consumer sent, then only its handshake and bind (as if the fetches
        # had not happened yet), each on a connection of its own.
        back_all = replay(producer.lane_port, up)
        back_bind = replay(producer.lane_port, b"".join(first_records[:4]))

        wait_until(
            lambda: (
                producer.control_stats["lane_dropped_handshake"]
                == before["lane_dropped_handshake"] + 2
            ),
            timeout_s=5,
            detail=lambda: lane_stats(producer.control_stats),
        )
        stats = producer.control_stats
        assert stats["lane_bound"] == before["lane_bound"] == 1
        assert stats["lane_closed"] == before["lane_closed"] == 0  # the live lane untouched
        assert stats["lane_received"] == before["lane_received"]
        assert producer.counters["fetch_requests"] == served_before
        # Each replay got at most a handshake flight of its own (a new server random,
        # so new keys that the recorded records cannot open), then the end of the
        # connection; the producer fails such a handshake at the recorded Finished.
        live_random = bytes(live.down)[11:43]
        for back in (back_all, back_bind):
            assert live_random not in back
            assert not back or back[0] == 22  # a handshake record, nothing sealed

        consumer.fetch(["b"], [via_observer])[0].result(timeout=10)
        np.testing.assert_array_equal(stored_bytes(node, "b"), expected("b", 9))
        assert consumer.counters["lane_requests"] == 2
        assert not any(k.startswith("lanes_lost.") for k in consumer.counters)
        assert producer.control_stats["lane_bound"] == 1
    finally:
        lane.close()
        control.close()


# -- no (key, nonce) twice ---------------------------------------------------------------------

_SUITES = {  # TLS 1.3 cipher suite: (AEAD, key bytes, HKDF hash)
    b"\x13\x01": (AESGCM, 16, hashes.SHA256),
    b"\x13\x02": (AESGCM, 32, hashes.SHA384),
    b"\x13\x03": (ChaCha20Poly1305, 32, hashes.SHA256),
}


def expand_label(secret: bytes, label: bytes, length: int, algorithm: type) -> bytes:
    """HKDF-Expand-Label(secret, label, "", length) of RFC 8446 section 7.1."""
    full = b"tls13 " + label
    info = length.to_bytes(2, "big") + bytes((len(full),)) + full + b"\x00"
    return HKDFExpand(algorithm(), length, info).derive(secret)


def key_log(path: Path) -> dict[tuple[str, bytes], bytes]:
    """(label, client random) -> secret, from an SSLKEYLOGFILE."""
    out: dict[tuple[str, bytes], bytes] = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) == 3:
            out[(parts[0], bytes.fromhex(parts[1]))] = bytes.fromhex(parts[2])
    return out


def used_pairs(
    conn: Recorded, secrets: dict[tuple[str, bytes], bytes]
) -> list[tuple[bytes, bytes]]:
    """Every (key, nonce) the connection's encrypted records were sealed under, in order,
    each proven by opening the record under it."""
    up, down = bytes(conn.up), bytes(conn.down)
    client_random = up[11:43]  # record header, handshake header, version
    session_id_len = down[43]
    suite = down[44 + session_id_len : 46 + session_id_len]
    aead, key_len, algorithm = _SUITES[suite]
    pairs: list[tuple[bytes, bytes]] = []
    for stream, side in ((up, "CLIENT"), (down, "SERVER")):
        labels = [f"{side}_HANDSHAKE_TRAFFIC_SECRET", f"{side}_TRAFFIC_SECRET_0"]
        keys = []
        for label in labels:
            secret = secrets[(label, client_random)]
            keys.append(
                (
                    expand_label(secret, b"key", key_len, algorithm),
                    expand_label(secret, b"iv", 12, algorithm),
                )
            )
        epoch, seq = 0, 0
        for kind, header, body in records(stream):
            if kind != 23:  # handshake in the clear, ChangeCipherSpec
                continue
            while True:
                key, iv = keys[epoch]
                nonce = (int.from_bytes(iv, "big") ^ seq).to_bytes(12, "big")
                try:
                    aead(key).decrypt(nonce, body, header)
                    break
                except InvalidTag:
                    assert epoch + 1 < len(keys) and seq > 0, (
                        "a record sealed under no expected key"
                    )
                    epoch, seq = epoch + 1, 0
            pairs.append((key, nonce))
            seq += 1
    return pairs


class LaneLoop:
    """A LaneServer on a thread of its own, answering each FetchRequest with a
    FetchReply; the relay in front of it."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.server = LaneServer(
            host="127.0.0.1", poller=self.poller, max_frame_bytes=4096, bind_timeout_s=2
        )
        self.relay = Relay(("127.0.0.1", self.server.port))
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def offer(self, sid: str) -> p.LaneOffer:
        with self._lock:
            return self.server.offer(sid)

    def _run(self) -> None:
        while not self._stop.is_set():
            events = dict(self.poller.poll(10))
            with self._lock:
                for sid, msg in self.server.receive(events):
                    if isinstance(msg, p.FetchRequest):
                        self.server.send(sid, p.FetchReply(request_id=msg.request_id, items=[]))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.relay.close()
        self.server.close()


def round_trips(offer: p.LaneOffer, sid: str, port: int, count: int) -> None:
    """One lane connection of a consumer, `count` requests each answered, then closed."""
    client = LaneClient(
        OBSERVER_HOST,
        p.LaneOffer(port, offer.key, offer.cert_sha256),
        session_id=sid,
        max_frame_bytes=4096,
    )
    poller = zmq.Poller()
    answered, sent = 0, 0
    deadline = time.monotonic() + 10
    while answered < count or not client.usable:
        assert time.monotonic() < deadline and client.broken is None, client.broken
        if client.usable and sent < count:
            assert client.send(
                p.FetchRequest(session_id=sid, request_id=f"r{sent}", items=[p.ItemRequest("h")])
            )
            sent += 1
        poller.register(client.fileno(), client.poll_flags)
        for _fd, flags in poller.poll(20):
            answered += sum(isinstance(m, p.FetchReply) for m in client.on_event(flags))
    client.close()


@pytest.fixture
def key_logged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LaneLoop, Path]]:
    keylog = tmp_path / "keys.log"
    monkeypatch.setenv("SSLKEYLOGFILE", str(keylog))
    loop = LaneLoop()
    yield loop, keylog
    loop.close()


@settings(
    max_examples=15,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    reconnects=st.lists(
        st.tuples(st.sampled_from(["s1", "s2"]), st.integers(min_value=0, max_value=6)),
        min_size=1,
        max_size=6,
    )
)
def test_no_key_and_nonce_pair_is_ever_sealed_twice(
    key_logged: tuple[LaneLoop, Path], reconnects: list[tuple[str, int]]
) -> None:
    loop, keylog = key_logged
    sids = {name: f"{name}-{uuid.uuid4().hex}" for name in ("s1", "s2")}
    offers = {name: loop.offer(sid) for name, sid in sids.items()}  # one key per session
    first = len(loop.relay.connections)

    for name, count in reconnects:  # each a new connection with the session's one key
        round_trips(offers[name], sids[name], loop.relay.port, count)

    connections = loop.relay.connections[first:]
    assert len(connections) == len(reconnects)
    for conn in connections:
        assert conn.done.wait(5)
    secrets = key_log(keylog)
    seen: set[tuple[bytes, bytes]] = set()
    total = 0
    for conn, (_name, count) in zip(connections, reconnects, strict=True):
        pairs = used_pairs(conn, secrets)
        # Each direction: its handshake records, the bind (up), then one per frame.
        assert len(pairs) >= 2 + 2 * count
        seen.update(pairs)
        total += len(pairs)
    assert len(seen) == total
