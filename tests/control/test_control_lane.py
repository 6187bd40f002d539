"""The fetch lane's two ends over real TCP sockets on 127.0.0.1.

The hostile side is written here from the wire's description in
ecshare/control/lane.py (its own ChaCha20-Poly1305 seals), not with the module's
helpers, so that the tests hold the module to the documented format.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import zmq
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from ecshare import protocol as p
from ecshare.control import LaneClient, LaneServer

pytestmark = pytest.mark.timeout(30)

C2P, P2C = 1, 2


def seal(key: bytes, sid: str, direction: int, counter: int, plain: bytes) -> bytes:
    nonce = bytes((direction, 0, 0, 0)) + struct.pack(">Q", counter)
    aad = b"ecshare-lane/1 " + sid.encode()
    return struct.pack(">Q", counter) + ChaCha20Poly1305(key).encrypt(nonce, plain, aad)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def bind_frame(key: bytes, sid: str) -> bytes:
    return frame(bytes((len(sid),)) + sid.encode() + seal(key, sid, C2P, 0, b""))


def fetch(sid: str, rid: str = "r1") -> p.FetchRequest:
    return p.FetchRequest(session_id=sid, request_id=rid, items=[p.ItemRequest("h")])


class Served:
    """A LaneServer driven on a thread of its own: it answers every FetchRequest with
    an empty FetchReply, as a producer would through its `_handle`."""

    def __init__(self) -> None:
        self.poller = zmq.Poller()
        self.server = LaneServer(
            host="127.0.0.1", poller=self.poller, max_frame_bytes=4096, bind_timeout_s=0.3
        )
        self.received: list[tuple[str, p.Message]] = []
        self._lock = threading.Lock()
        self._offers: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def offer(self) -> tuple[str, p.LaneOffer]:
        sid = uuid.uuid4().hex
        with self._lock:
            # Made here, on the test's thread, before the serving thread sees the lane;
            # the server's dict insert is one step.
            offer = self.server.offer(sid)
        return sid, offer

    def _run(self) -> None:
        while not self._stop.is_set():
            events = dict(self.poller.poll(20))
            for sid, msg in self.server.receive(events):
                self.received.append((sid, msg))
                if isinstance(msg, p.FetchRequest):
                    self.server.send(sid, p.FetchReply(request_id=msg.request_id, items=[]))
            self.server.expire(time.monotonic())

    @property
    def stats(self) -> dict[str, int]:
        return dict(self.server.stats)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.server.close()


@pytest.fixture
def served() -> Iterator[Served]:
    s = Served()
    yield s
    s.close()


def connect(served: Served) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", served.server.port), timeout=2)
    sock.settimeout(2)
    return sock


def closed_without_a_byte(sock: socket.socket) -> bool:
    """The peer closed the connection and never sent anything on it."""
    try:
        data = sock.recv(65536)
    except ConnectionResetError:
        return True
    return data == b""


def wait_for(predicate: object, timeout_s: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def read_frame(sock: socket.socket) -> bytes:
    head = b""
    while len(head) < 4:
        chunk = sock.recv(4 - len(head))
        assert chunk, "closed"
        head += chunk
    (n,) = struct.unpack(">I", head)
    body = b""
    while len(body) < n:
        chunk = sock.recv(n - len(body))
        assert chunk, "closed"
        body += chunk
    return body


def test_a_sealed_request_is_answered_sealed_in_order(served: Served) -> None:
    sid, offer = served.offer()
    sock = connect(served)
    codec = p.Codec()
    sock.sendall(bind_frame(offer.key, sid))
    sock.sendall(frame(seal(offer.key, sid, C2P, 1, codec.encode(fetch(sid, "r1")))))
    sock.sendall(frame(seal(offer.key, sid, C2P, 2, codec.encode(fetch(sid, "r2")))))

    for counter, rid in ((0, "r1"), (1, "r2")):
        body = read_frame(sock)
        assert struct.unpack(">Q", body[:8])[0] == counter
        nonce = bytes((P2C, 0, 0, 0)) + body[:8]
        plain = ChaCha20Poly1305(offer.key).decrypt(
            nonce, body[8:], b"ecshare-lane/1 " + sid.encode()
        )
        reply = codec.decode(plain)
        assert isinstance(reply, p.FetchReply) and reply.request_id == rid
    assert served.stats["lane_bound"] == 1
    assert served.stats["lane_received"] == 2


def test_a_client_without_the_key_gets_no_byte_and_is_dropped(served: Served) -> None:
    served.offer()
    silent = connect(served)  # says nothing: dropped at the bind deadline
    garbage = connect(served)
    garbage.sendall(b"\x00\x00\x00\x10" + b"x" * 16)

    assert closed_without_a_byte(garbage)
    assert closed_without_a_byte(silent)
    assert wait_for(lambda: served.stats["lane_dropped_bind_timeout"] == 1)
    assert served.stats["lane_dropped_bad_bind"] == 1
    assert served.stats["lane_bound"] == 0


def test_a_wrong_key_is_refused_before_anything_is_sent(served: Served) -> None:
    sid, _offer = served.offer()
    sock = connect(served)
    sock.sendall(bind_frame(b"k" * 32, sid))
    sock.sendall(frame(seal(b"k" * 32, sid, C2P, 1, p.Codec().encode(fetch(sid)))))

    assert closed_without_a_byte(sock)
    assert wait_for(lambda: served.stats["lane_dropped_bad_key"] == 1)
    assert served.received == []


def test_a_bind_for_a_session_never_offered_is_refused(served: Served) -> None:
    sid = uuid.uuid4().hex
    sock = connect(served)
    sock.sendall(bind_frame(b"k" * 32, sid))

    assert closed_without_a_byte(sock)
    assert wait_for(lambda: served.stats["lane_dropped_unknown_session"] == 1)


def test_a_key_opens_only_its_own_session(served: Served) -> None:
    sid_a, offer_a = served.offer()
    sid_b, _offer_b = served.offer()
    # A's key, B's session id: the seal binds the id, so it does not open.
    sock = connect(served)
    sock.sendall(
        frame(bytes((len(sid_b),)) + sid_b.encode() + seal(offer_a.key, sid_a, C2P, 0, b""))
    )
    assert closed_without_a_byte(sock)
    assert wait_for(lambda: served.stats["lane_dropped_bad_key"] == 1)
    # A's own lane naming B's session in a message: dropped, and A's lane closed.
    sock = connect(served)
    sock.sendall(bind_frame(offer_a.key, sid_a))
    sock.sendall(frame(seal(offer_a.key, sid_a, C2P, 1, p.Codec().encode(fetch(sid_b)))))
    assert closed_without_a_byte(sock)
    assert wait_for(lambda: served.stats["lane_dropped_foreign_session"] == 1)
    assert served.received == []


@pytest.mark.parametrize(
    ("fault", "counter"),
    [
        ("replayed", "lane_dropped_replayed"),
        ("reordered", "lane_dropped_replayed"),
        ("reflected", "lane_dropped_forged"),
        ("garbage", "lane_dropped_forged"),
        ("oversized", "lane_dropped_oversized"),
        ("truncated", "lane_dropped_truncated"),
        ("not_a_message", "lane_dropped_malformed"),
        ("wrong_kind", "lane_dropped_unexpected_kind"),
    ],
)
def test_a_bad_frame_on_a_bound_lane_is_dropped_and_closes_it(
    served: Served, fault: str, counter: str
) -> None:
    sid, offer = served.offer()
    key, codec = offer.key, p.Codec()
    sock = connect(served)
    sock.sendall(bind_frame(key, sid))
    first = frame(seal(key, sid, C2P, 1, codec.encode(fetch(sid, "r1"))))
    sock.sendall(first)
    read_frame(sock)  # the answer to the good one
    bad = {
        "replayed": first,
        "reordered": frame(seal(key, sid, C2P, 3, codec.encode(fetch(sid, "r3")))),
        # Sealed as the producer would seal its own frames, sent back to it.
        "reflected": frame(seal(key, sid, P2C, 2, codec.encode(fetch(sid, "r2")))),
        "garbage": frame(struct.pack(">Q", 2) + b"\x01" * 40),
        "oversized": struct.pack(">I", 1 << 20) + b"\x00" * 64,
        "truncated": frame(seal(key, sid, C2P, 2, codec.encode(fetch(sid, "r2"))))[:-5],
        "not_a_message": frame(seal(key, sid, C2P, 2, b"\xc1 not msgpack")),
        "wrong_kind": frame(seal(key, sid, C2P, 2, codec.encode(p.Bye(session_id=sid)))),
    }[fault]
    sock.sendall(bad)
    if fault == "truncated":
        sock.shutdown(socket.SHUT_WR)

    assert closed_without_a_byte(sock)
    assert wait_for(lambda: served.stats[counter] == 1), served.stats
    assert served.stats["lane_closed"] == 1
    assert [m.request_id for _, m in served.received if isinstance(m, p.FetchRequest)] == ["r1"]


def test_unbound_connections_are_bounded(served: Served) -> None:
    from ecshare.control.lane import MAX_UNBOUND

    socks = [connect(served) for _ in range(MAX_UNBOUND + 3)]
    assert wait_for(lambda: served.stats["lane_accepted"] == MAX_UNBOUND + 3)
    assert served.stats["lane_refused_unbound"] == 3
    for sock in socks:
        sock.close()


def test_the_client_end_talks_to_the_server_end(served: Served) -> None:
    sid, offer = served.offer()
    client = LaneClient("127.0.0.1", offer, session_id=sid, max_frame_bytes=4096)
    poller = zmq.Poller()
    got: list[p.Message] = []
    sent = False
    deadline = time.monotonic() + 3
    while not got and time.monotonic() < deadline:
        poller.register(client.fileno(), client.poll_flags)
        for _fd, flags in poller.poll(50):
            got.extend(client.on_event(flags))
        if client.usable and not sent:
            sent = client.send(fetch(sid, "r9"))
    client.close()
    assert client.broken == "closed"
    assert [type(m) for m in got] == [p.FetchReply]


def test_a_client_whose_lane_is_refused_says_why(served: Served) -> None:
    sid = uuid.uuid4().hex
    offer = p.LaneOffer(port=served.server.port, key=b"k" * 32)  # never offered
    client = LaneClient("127.0.0.1", offer, session_id=sid, max_frame_bytes=4096)
    poller = zmq.Poller()
    deadline = time.monotonic() + 3
    while client.broken is None and time.monotonic() < deadline:
        poller.register(client.fileno(), client.poll_flags)
        for _fd, flags in poller.poll(50):
            client.on_event(flags)
    assert client.broken in ("eof", "error")
    assert not client.usable
