"""The fetch lane's two ends over real TCP sockets on 127.0.0.1.

The hostile side is written here from the wire's description in
ecshare/control/lane.py (TLS 1.3 through Python's own `ssl`, the certificate
pinned by its SHA-256, then length-prefixed frames), not with the module's
helpers, so that the tests hold the module to the documented format.
"""

from __future__ import annotations

import hashlib
import socket
import ssl
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterator

import msgspec
import pytest
import zmq

from ecshare import protocol as p
from ecshare.control import LaneClient, LaneServer
from ecshare.vllm.servers import free_port

pytestmark = pytest.mark.timeout(30)


def frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


def bind_frame(key: bytes, sid: str) -> bytes:
    return frame(bytes((len(sid),)) + sid.encode() + key)


def fetch(sid: str, rid: str = "r1") -> p.FetchRequest:
    return p.FetchRequest(session_id=sid, request_id=rid, items=[p.ItemRequest("h")])


class Tls:
    """A TLS 1.3 client over a blocking socket, through memory BIOs so that a test
    sees (and can resend, reorder or forge) each record it puts on the wire."""

    def __init__(self, sock: socket.socket, offer: p.LaneOffer) -> None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.minimum_version = ssl.TLSVersion.TLSv1_3
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        self.sock = sock
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._in, self._out)
        self.received = b""  # every byte the server sent, as it came
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._exchange()
        sock.sendall(self._out.read())  # our Finished
        cert = self.tls.getpeercert(binary_form=True) or b""
        assert hashlib.sha256(cert).digest() == offer.cert_sha256, "not the pinned certificate"

    def seal(self, plain: bytes) -> bytes:
        """The records carrying `plain`, not sent."""
        self.tls.write(plain)
        return self._out.read()

    def send(self, plain: bytes) -> bytes:
        records = self.seal(plain)
        self.sock.sendall(records)
        return records

    def read_frame(self) -> bytes:
        """One frame's body; the raw records it came in are appended to `received`."""
        buf = b""
        while True:
            if len(buf) >= 4 and len(buf) >= 4 + struct.unpack(">I", buf[:4])[0]:
                return buf[4:]
            try:
                buf += self.tls.read(65536)
            except ssl.SSLWantReadError:
                data = self.sock.recv(65536)
                assert data, "closed"
                self.received += data
                self._in.write(data)

    def closed_with_nothing_more(self) -> bool:
        """The server closed the connection and sent no record after the handshake."""
        try:
            data = self.sock.recv(65536)
        except ConnectionResetError:
            return True
        return data == b""

    def _exchange(self) -> None:
        out = self._out.read()
        if out:
            self.sock.sendall(out)
        data = self.sock.recv(65536)
        assert data, "closed during the handshake"
        self.received += data
        self._in.write(data)


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


def tls(served: Served, offer: p.LaneOffer) -> Tls:
    return Tls(connect(served), offer)


def test_a_request_is_answered_in_order_inside_tls(served: Served) -> None:
    sid, offer = served.offer()
    conn = tls(served, offer)
    codec = p.Codec()
    conn.send(bind_frame(offer.key, sid))
    conn.send(frame(codec.encode(fetch(sid, "r1"))) + frame(codec.encode(fetch(sid, "r2"))))

    for rid in ("r1", "r2"):
        reply = codec.decode(conn.read_frame())
        assert isinstance(reply, p.FetchReply) and reply.request_id == rid
    assert served.stats["lane_bound"] == 1
    assert served.stats["lane_received"] == 2


def test_a_stranger_gets_no_byte_and_is_dropped(served: Served) -> None:
    served.offer()
    silent = connect(served)  # says nothing: dropped at the bind deadline
    garbage = connect(served)
    garbage.sendall(b"\x00\x00\x00\x10" + b"x" * 16)  # not TLS

    assert closed_without_a_byte(garbage)
    assert closed_without_a_byte(silent)
    assert wait_for(lambda: served.stats["lane_dropped_bind_timeout"] == 1)
    assert served.stats["lane_dropped_handshake"] == 1
    assert served.stats["lane_bound"] == 0


def test_a_handshake_without_a_bind_is_dropped_at_the_deadline(served: Served) -> None:
    _sid, offer = served.offer()
    conn = tls(served, offer)

    assert conn.closed_with_nothing_more()
    assert wait_for(lambda: served.stats["lane_dropped_bind_timeout"] == 1)
    assert served.stats["lane_bound"] == 0


def test_a_wrong_key_is_refused_and_nothing_is_sent_after_the_handshake(served: Served) -> None:
    sid, offer = served.offer()
    conn = tls(served, offer)
    conn.send(bind_frame(b"k" * 32, sid) + frame(p.Codec().encode(fetch(sid))))

    assert conn.closed_with_nothing_more()
    assert wait_for(lambda: served.stats["lane_dropped_bad_key"] == 1)
    assert served.received == []


def test_a_bind_for_a_session_never_offered_is_refused(served: Served) -> None:
    _sid, offer = served.offer()
    conn = tls(served, offer)
    conn.send(bind_frame(b"k" * 32, uuid.uuid4().hex))

    assert conn.closed_with_nothing_more()
    assert wait_for(lambda: served.stats["lane_dropped_unknown_session"] == 1)


@pytest.mark.parametrize(
    "bind",
    [b"", b"\x00" + b"k" * 32, b"\x05abc", b"\x02\xff\xfe" + b"k" * 32],
    ids=["empty", "no_session_id", "short", "not_ascii"],
)
def test_a_first_frame_that_is_no_bind_is_refused(served: Served, bind: bytes) -> None:
    _sid, offer = served.offer()
    conn = tls(served, offer)
    conn.send(frame(bind))

    assert conn.closed_with_nothing_more()
    assert wait_for(lambda: served.stats["lane_dropped_bad_bind"] == 1)


@pytest.mark.parametrize("bind", ["wrong_key", "no_bind", "not_tls"])
def test_an_unproven_connection_leaves_the_sessions_live_lane_alone(
    served: Served, bind: str
) -> None:
    sid, offer = served.offer()
    codec = p.Codec()
    live = tls(served, offer)
    live.send(bind_frame(offer.key, sid) + frame(codec.encode(fetch(sid, "r1"))))
    live.read_frame()
    if bind == "not_tls":
        rival = connect(served)
        rival.sendall(b"\x00\x00\x00\x10" + b"x" * 16)
        assert closed_without_a_byte(rival)
        drop = "lane_dropped_handshake"
    else:
        conn = tls(served, offer)
        if bind == "wrong_key":
            conn.send(bind_frame(b"k" * 32, sid))
        else:
            conn.sock.shutdown(socket.SHUT_WR)
        assert conn.closed_with_nothing_more()
        drop = "lane_dropped_bad_key" if bind == "wrong_key" else "lane_dropped_bad_bind"
    assert wait_for(lambda: served.stats[drop] == 1)

    live.send(frame(codec.encode(fetch(sid, "r2"))))
    reply = codec.decode(live.read_frame())
    assert isinstance(reply, p.FetchReply) and reply.request_id == "r2"
    assert served.stats["lane_closed"] == 0


def test_a_key_opens_only_its_own_session(served: Served) -> None:
    sid_a, offer_a = served.offer()
    sid_b, _offer_b = served.offer()
    # A's key, B's session id.
    conn = tls(served, offer_a)
    conn.send(bind_frame(offer_a.key, sid_b))
    assert conn.closed_with_nothing_more()
    assert wait_for(lambda: served.stats["lane_dropped_bad_key"] == 1)
    # A's own lane naming B's session in a message: dropped, and A's lane closed.
    conn = tls(served, offer_a)
    conn.send(bind_frame(offer_a.key, sid_a) + frame(p.Codec().encode(fetch(sid_b))))
    assert conn.closed_with_nothing_more()
    assert wait_for(lambda: served.stats["lane_dropped_foreign_session"] == 1)
    assert served.received == []


@pytest.mark.parametrize(
    ("fault", "counter"),
    [
        ("replayed", "lane_dropped_forged"),
        ("reordered", "lane_dropped_forged"),
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
    codec = p.Codec()
    conn = tls(served, offer)
    conn.send(bind_frame(offer.key, sid))
    first = conn.send(frame(codec.encode(fetch(sid, "r1"))))
    before = len(conn.received)
    conn.read_frame()  # the answer to the good one
    answer = conn.received[before:]

    def second_of_two() -> bytes:
        conn.seal(frame(codec.encode(fetch(sid, "r2"))))  # sealed, never sent
        return conn.seal(frame(codec.encode(fetch(sid, "r3"))))

    bad = {
        "replayed": lambda: first,  # the same record again: its sequence number is past
        "reordered": second_of_two,
        "reflected": lambda: answer,  # the producer's own record, sent back to it
        "garbage": lambda: b"\x17\x03\x03\x00\x30" + b"\x01" * 48,
        "oversized": lambda: conn.seal(struct.pack(">I", 1 << 20) + b"\x00" * 64),
        "truncated": lambda: conn.seal(frame(codec.encode(fetch(sid, "r2")))[:-5]),
        "not_a_message": lambda: conn.seal(frame(b"\xc1 not msgpack")),
        "wrong_kind": lambda: conn.seal(frame(codec.encode(p.Bye(session_id=sid)))),
    }[fault]()
    conn.sock.sendall(bad)
    if fault == "truncated":
        conn.sock.shutdown(socket.SHUT_WR)

    assert conn.closed_with_nothing_more()
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


def drive(
    client: LaneClient, until: Callable[[list[p.Message]], bool], timeout_s: float = 3.0
) -> list[p.Message]:
    """Poll the client as a consumer's network thread does, until `until(got)` holds."""
    poller = zmq.Poller()
    got: list[p.Message] = []
    deadline = time.monotonic() + timeout_s
    while not until(got) and time.monotonic() < deadline:
        poller.register(client.fileno(), client.poll_flags)
        for _fd, flags in poller.poll(50):
            got.extend(client.on_event(flags))
    return got


def test_the_client_end_talks_to_the_server_end(served: Served) -> None:
    sid, offer = served.offer()
    client = LaneClient("127.0.0.1", offer, session_id=sid, max_frame_bytes=4096)
    assert not client.usable  # not before the handshake has completed
    drive(client, lambda _got: client.usable)
    assert client.send(fetch(sid, "r9"))
    got = drive(client, bool)
    client.close()
    assert client.broken == "closed"
    assert [type(m) for m in got] == [p.FetchReply]


def test_a_client_whose_lane_is_refused_says_why(served: Served) -> None:
    _sid, offer = served.offer()
    sid = uuid.uuid4().hex  # a session the server never offered a lane to
    client = LaneClient("127.0.0.1", offer, session_id=sid, max_frame_bytes=4096)
    drive(client, lambda _got: client.broken is not None)
    assert client.broken in ("eof", "error")
    assert not client.usable
    assert served.stats["lane_dropped_unknown_session"] == 1


def test_a_client_never_sends_its_key_to_a_server_it_was_not_told_of(served: Served) -> None:
    sid, offer = served.offer()
    other = p.LaneOffer(port=offer.port, key=offer.key, cert_sha256=hashlib.sha256(b"x").digest())
    client = LaneClient("127.0.0.1", other, session_id=sid, max_frame_bytes=4096)
    drive(client, lambda _got: client.broken is not None)
    assert client.broken == "bad_certificate"
    client.close()
    # The server got a handshake and then the end of the stream: never a bind.
    assert wait_for(lambda: served.stats["lane_dropped_bad_bind"] == 1)
    assert served.stats["lane_bound"] == 0


def test_a_taken_lane_port_is_a_clear_error(served: Served) -> None:
    from ecshare.control import ControlConfigError

    with pytest.raises(ControlConfigError, match=f"port {served.server.port} \\(lane_port\\)"):
        LaneServer(
            host="127.0.0.1",
            poller=zmq.Poller(),
            max_frame_bytes=4096,
            bind_timeout_s=1,
            port=served.server.port,
        )


def test_a_configured_lane_port_is_the_one_offered() -> None:
    port = free_port()
    server = LaneServer(
        host="127.0.0.1", poller=zmq.Poller(), max_frame_bytes=4096, bind_timeout_s=1, port=port
    )
    try:
        assert server.port == port
        assert server.offer("s").port == port
    finally:
        server.close()


def test_an_offer_of_an_earlier_release_is_declined_and_nothing_is_sent() -> None:
    # The lane offer as a producer of the release before TLS encodes it: port and key.
    earlier = msgspec.msgpack.encode([4242, b"k" * 32])
    offer = msgspec.msgpack.decode(earlier, type=p.LaneOffer)
    assert offer.cert_sha256 is None

    client = LaneClient("127.0.0.1", offer, session_id="s", max_frame_bytes=4096)
    assert client.broken == "no_certificate"
    assert not client.usable
    assert not client.send(fetch("s"))
    client.close()
