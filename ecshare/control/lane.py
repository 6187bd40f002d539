"""The fetch lane: an authenticated TCP side channel for a session's hot messages.

Why it exists (measured on 2 vCPUs, two processes, a 5 ms idle gap between
round trips of 200-byte messages): a ZMQ CURVE DEALER/ROUTER round trip takes
0.50 to 0.59 ms at p50, because each message crosses the sender's and the
receiver's ZMQ I/O threads and each of those wakes from idle; a plain TCP round
trip between the same two threads takes 0.15 to 0.18 ms, and with an AEAD seal
and open on both ends about 0.3 ms. A sporadic fetch pays one such round trip,
so its requests and their answers go here when the producer offers a lane.

ZMQ stays the session's authority: the CURVE handshake and the allow-list admit
the consumer, Hello/Welcome open the session, heartbeats, pushes, Bye and status
stay there. The producer's `Welcome` (CURVE-encrypted) offers a lane: a TCP port
beside its ROUTER and a fresh random 32-byte key for this session only, so only
the authenticated consumer that opened the session learns it.

The wire, each frame `length:u32be body`:

    bind (the consumer's first frame):  sid_len:u8 sid counter:u64be seal(b"")
    every frame after it, both ways:    counter:u64be seal(message)

`seal` is ChaCha20-Poly1305 under the session's key, the nonce the direction
(one byte: consumer to producer, or back) and the frame's counter, the
associated data the session id. Counters start at 0 each way and go up by one a
frame, and a receiver takes only the next one, so a replayed, reordered,
reflected or dropped frame fails, and so does a frame sealed for another session.
The producer sends nothing to a connection before its bind frame has proven the
key (invariant 5: no peer learns anything before it authenticates), holds at
most `MAX_UNBOUND` such connections, each for `bind_timeout_s`, and takes no
frame over the frame limit. Anything wrong is a counted drop and a closed lane,
never an exception out of here: the consumer then goes on over ZMQ.

The messages inside are `ecshare.protocol` messages, encoded as on ZMQ; only
the kinds in `LANE_CONSUMER_TO_PRODUCER` and `LANE_PRODUCER_TO_CONSUMER` travel
here, and each names the lane's own session.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Iterator
from typing import Final

import zmq
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import ChaCha20Poly1305

from ecshare import protocol as p

log = logging.getLogger(__name__)

KEY_BYTES: Final = 32
# Connections accepted whose bind frame has not come yet; more are closed at once.
MAX_UNBOUND: Final = 64
LANE_CONSUMER_TO_PRODUCER: Final[frozenset[type]] = frozenset({p.FetchRequest, p.Release})
LANE_PRODUCER_TO_CONSUMER: Final[frozenset[type]] = frozenset({p.FetchReply, p.Released, p.Error})

_C2P: Final = 1
_P2C: Final = 2
_AAD_PREFIX: Final = b"ecshare-lane/1 "
_TAG: Final = 16
_HEAD = struct.Struct(">I")
_COUNTER = struct.Struct(">Q")
_MAX_BIND: Final = 1 + 128 + _COUNTER.size + _TAG
# recv() allocates its whole size each call: 256 KiB cost 30 us against 4 for 64 KiB.
_RECV_CHUNK: Final = 64 * 1024
# Bytes a lane may hold unsent (a peer that stops reading) before it is closed.
_MAX_UNSENT_FRAMES: Final = 4

DROP_REASONS: Final = (
    "bind_timeout",  # no bind frame in time
    "bad_bind",  # a first frame that is not a bind frame
    "unknown_session",  # bind for a session with no lane offered
    "bad_key",  # the bind frame's seal does not open: not the session's key
    "forged",  # a later frame's seal does not open
    "replayed",  # a frame out of counter order (replay, reorder)
    "oversized",  # a frame over the limit
    "truncated",  # the connection ended inside a frame
    "malformed",  # opens, but is no valid message
    "unexpected_kind",  # a valid message that does not travel on a lane
    "foreign_session",  # a message naming another session than the lane's
    "send_overflow",  # the peer stopped reading our answers
)
STAT_NAMES: Final = (
    "lane_accepted",
    "lane_bound",
    "lane_refused_unbound",
    "lane_closed",
    "lane_received",
    "lane_sent",
    *(f"lane_dropped_{reason}" for reason in DROP_REASONS),
)


class LaneBroken(Exception):
    """The lane is unusable; `reason` is one of DROP_REASONS, or "eof"/"error"."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _nonce(direction: int, counter: int) -> bytes:
    return bytes((direction, 0, 0, 0)) + _COUNTER.pack(counter)


class _Seal:
    """One direction of one lane: seals (or opens) its frames in counter order."""

    __slots__ = ("_aad", "_aead", "_direction", "counter")

    def __init__(self, key: bytes, session_id: str, direction: int) -> None:
        self._aead = ChaCha20Poly1305(key)
        self._aad = _AAD_PREFIX + session_id.encode("ascii")
        self._direction = direction
        self.counter = 0

    def seal(self, plaintext: bytes) -> bytes:
        counter = self.counter
        self.counter += 1
        nonce = _nonce(self._direction, counter)
        return _COUNTER.pack(counter) + self._aead.encrypt(nonce, plaintext, self._aad)

    def open(self, body: bytes | memoryview, forged: str = "forged") -> bytes:
        if len(body) < _COUNTER.size + _TAG:
            raise LaneBroken("truncated", "frame shorter than its seal")
        (counter,) = _COUNTER.unpack_from(body)
        if counter != self.counter:
            # Checked before the seal: a replay of a real frame opens fine.
            raise LaneBroken("replayed", f"counter {counter}, expected {self.counter}")
        try:
            plain = self._aead.decrypt(
                _nonce(self._direction, counter), bytes(body[_COUNTER.size :]), self._aad
            )
        except InvalidTag:
            raise LaneBroken(forged, "seal does not open") from None
        self.counter += 1
        return plain


class _Stream:
    """A non-blocking TCP connection with framing: whole frames in, buffered frames out."""

    def __init__(self, sock: socket.socket, max_body: int) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.fd = sock.fileno()
        self.max_body = max_body
        self._in = bytearray()
        self._out = bytearray()
        self.closed = False

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    def frames(self, limit: int | None = None) -> Iterator[bytes]:
        """Read what has arrived and yield each whole frame's body; raises LaneBroken."""
        limit = self.max_body if limit is None else limit
        while True:
            try:
                data = self.sock.recv(_RECV_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                raise LaneBroken("error", str(exc)) from None
            if not data:
                if self._in:
                    raise LaneBroken("truncated", f"{len(self._in)} bytes of a frame, then EOF")
                raise LaneBroken("eof")
            self._in += data
            if len(data) < _RECV_CHUNK:
                break
        while len(self._in) >= _HEAD.size:
            (n,) = _HEAD.unpack_from(self._in)
            if n > limit:
                raise LaneBroken("oversized", f"frame of {n} bytes, limit {limit}")
            if len(self._in) < _HEAD.size + n:
                return
            body = bytes(self._in[_HEAD.size : _HEAD.size + n])
            del self._in[: _HEAD.size + n]
            yield body
            limit = self.max_body  # only the first frame has a limit of its own

    def send(self, body: bytes) -> None:
        """Queue one frame and write what the socket takes; raises LaneBroken."""
        if len(self._out) > _MAX_UNSENT_FRAMES * (self.max_body + _HEAD.size):
            raise LaneBroken("send_overflow", f"{len(self._out)} bytes unsent")
        self._out += _HEAD.pack(len(body))
        self._out += body
        self.flush()

    def flush(self) -> None:
        while self._out:
            try:
                sent = self.sock.send(self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise LaneBroken("error", str(exc)) from None
            del self._out[:sent]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.sock.close()


def _body_limit(max_frame_bytes: int) -> int:
    return max_frame_bytes + _COUNTER.size + _TAG


# -- the producer's end ---------------------------------------------------------------------


class _Bound:
    __slots__ = ("inbound", "outbound", "session_id", "stream")

    def __init__(self, stream: _Stream, session_id: str, key: bytes) -> None:
        self.stream = stream
        self.session_id = session_id
        self.inbound = _Seal(key, session_id, _C2P)
        self.outbound = _Seal(key, session_id, _P2C)


class LaneServer:
    """The producer's lanes: one listening socket, the keys it offered, the connections.

    Use from the producer's network thread. It registers its descriptors with the
    `zmq.Poller` it is given; pass each poll's events to `receive`.
    """

    def __init__(
        self,
        *,
        host: str,
        poller: zmq.Poller,
        max_frame_bytes: int,
        bind_timeout_s: float,
        name: str = "ecshare lane server",
    ) -> None:
        self._poller = poller
        self._codec = p.Codec(max_frame_bytes)
        self._max_body = _body_limit(max_frame_bytes)
        self._bind_timeout_s = bind_timeout_s
        self.name = name
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._keys: dict[str, bytes] = {}  # session id -> the key offered for it
        self._unbound: dict[int, tuple[_Stream, float]] = {}  # fd -> (stream, deadline)
        self._bound: dict[int, _Bound] = {}  # fd -> lane
        self._by_session: dict[str, _Bound] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host.strip("[]"), 0))
            listener.listen(128)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._listener = listener
        self.port: int = listener.getsockname()[1]
        poller.register(listener.fileno(), zmq.POLLIN)

    # -- sessions --------------------------------------------------------------------------

    def offer(self, session_id: str) -> p.LaneOffer:
        """The lane for `session_id`: its key, made on first call and kept for the session."""
        key = self._keys.get(session_id)
        if key is None:
            key = self._keys[session_id] = new_key()
        return p.LaneOffer(port=self.port, key=key)

    def forget(self, session_id: str) -> None:
        """The session ended: its key is gone and its lane closed."""
        self._keys.pop(session_id, None)
        lane = self._by_session.get(session_id)
        if lane is not None:
            self._close(lane.stream)

    def bound(self, session_id: str) -> bool:
        return session_id in self._by_session

    def fds(self) -> list[int]:
        return [self._listener.fileno(), *self._unbound, *self._bound]

    # -- traffic ---------------------------------------------------------------------------

    def receive(self, events: dict[object, int]) -> list[tuple[str, p.Message]]:
        """The valid messages that arrived, as (session id, message), in order per lane."""
        out: list[tuple[str, p.Message]] = []
        for fd, flags in events.items():
            if not isinstance(fd, int):
                continue
            if fd == self._listener.fileno():
                self._accept()
            elif fd in self._bound:
                lane = self._bound[fd]
                if flags & zmq.POLLOUT:
                    self._flush(lane)
                if flags & (zmq.POLLIN | zmq.POLLERR) and fd in self._bound:
                    self._read(lane, out)
            elif fd in self._unbound:
                self._bind(self._unbound[fd][0], out)
        return out

    def send(self, session_id: str, message: p.Message) -> bool:
        """Seal and send `message` on the session's lane; False if it has none (or lost it)."""
        lane = self._by_session.get(session_id)
        if lane is None:
            return False
        frame = lane.outbound.seal(self._codec.encode(message))
        try:
            lane.stream.send(frame)
        except LaneBroken as exc:
            self._drop(lane.stream, exc)
            return False
        self.stats["lane_sent"] += 1
        self._want_write(lane.stream)
        return True

    def expire(self, now: float) -> None:
        """Close connections whose bind frame is late."""
        for stream, deadline in list(self._unbound.values()):
            if now >= deadline:
                self._drop(stream, LaneBroken("bind_timeout"))

    def close(self) -> None:
        for stream, _ in list(self._unbound.values()):
            self._close(stream)
        for lane in list(self._bound.values()):
            self._close(lane.stream)
        self._unregister(self._listener.fileno())
        self._listener.close()

    # -- inside ----------------------------------------------------------------------------

    def _accept(self) -> None:
        for _ in range(64):
            try:
                sock, _address = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors, say: the next poll tries again
                if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("%s: accept failed: %s", self.name, exc)
                return
            self.stats["lane_accepted"] += 1
            if len(self._unbound) >= MAX_UNBOUND:
                self.stats["lane_refused_unbound"] += 1
                sock.close()
                continue
            stream = _Stream(sock, self._max_body)
            self._unbound[stream.fd] = (stream, time.monotonic() + self._bind_timeout_s)
            self._poller.register(stream.fd, zmq.POLLIN)

    def _bind(self, stream: _Stream, out: list[tuple[str, p.Message]]) -> None:
        try:
            frames = stream.frames(limit=_MAX_BIND)
            body = next(frames, None)
            if body is None:
                return
            sid_len = body[0] if body else 0
            if not 0 < sid_len <= len(body) - 1 - _COUNTER.size - _TAG:
                raise LaneBroken("bad_bind", "no session id")
            try:
                session_id = body[1 : 1 + sid_len].decode("ascii")
            except UnicodeDecodeError:
                raise LaneBroken("bad_bind", "session id not ascii") from None
            key = self._keys.get(session_id)
            if key is None:
                raise LaneBroken("unknown_session")
            lane = _Bound(stream, session_id, key)
            lane.inbound.open(memoryview(body)[1 + sid_len :], forged="bad_key")
        except LaneBroken as exc:
            # A stranger that connects and leaves without a word is a bad bind too.
            unbound = LaneBroken("bad_bind", str(exc)) if exc.reason in ("eof", "error") else exc
            self._drop(stream, unbound)
            return
        del self._unbound[stream.fd]
        old = self._by_session.get(session_id)
        if old is not None:
            self._close(old.stream)  # the session's consumer connected again
        self._bound[stream.fd] = lane
        self._by_session[session_id] = lane
        self.stats["lane_bound"] += 1
        self._take(lane, frames, out)

    def _read(self, lane: _Bound, out: list[tuple[str, p.Message]]) -> None:
        self._take(lane, lane.stream.frames(), out)

    def _take(
        self, lane: _Bound, frames: Iterator[bytes], out: list[tuple[str, p.Message]]
    ) -> None:
        try:
            for body in frames:
                plain = lane.inbound.open(body)
                try:
                    message = self._codec.decode(plain)
                except p.ProtocolError as exc:
                    raise LaneBroken("malformed", str(exc)) from None
                if type(message) not in LANE_CONSUMER_TO_PRODUCER:
                    raise LaneBroken("unexpected_kind", type(message).__name__)
                if getattr(message, "session_id", None) != lane.session_id:
                    raise LaneBroken("foreign_session")
                self.stats["lane_received"] += 1
                out.append((lane.session_id, message))
        except LaneBroken as exc:
            self._drop(lane.stream, exc)

    def _flush(self, lane: _Bound) -> None:
        try:
            lane.stream.flush()
        except LaneBroken as exc:
            self._drop(lane.stream, exc)
            return
        self._want_write(lane.stream)

    def _want_write(self, stream: _Stream) -> None:
        if not stream.closed:
            flags = zmq.POLLIN | (zmq.POLLOUT if stream.wants_write else 0)
            self._poller.modify(stream.fd, flags)

    def _drop(self, stream: _Stream, exc: LaneBroken) -> None:
        if exc.reason in DROP_REASONS:
            self.stats[f"lane_dropped_{exc.reason}"] += 1
            log.debug("%s: dropped a lane: %s", self.name, exc)
        self._close(stream)

    def _close(self, stream: _Stream) -> None:
        fd = stream.fd
        if self._unbound.pop(fd, None) is None:
            lane = self._bound.pop(fd, None)
            if lane is not None:
                self.stats["lane_closed"] += 1
                if self._by_session.get(lane.session_id) is lane:
                    del self._by_session[lane.session_id]
        self._unregister(fd)
        stream.close()

    def _unregister(self, fd: int) -> None:
        with contextlib.suppress(KeyError):
            self._poller.unregister(fd)


# -- the consumer's end ---------------------------------------------------------------------


class LaneClient:
    """A consumer's lane to one producer, for one session. Use from one thread.

    Connects without blocking: poll `fileno()` for `poll_flags`, and call `on_event`
    with what the poll said. `usable` once connected (the bind frame is queued
    first, so frames sent after it follow it); `broken` says why it is not, after
    which nothing here is used again.
    """

    def __init__(
        self,
        host: str,
        offer: p.LaneOffer,
        *,
        session_id: str,
        max_frame_bytes: int,
    ) -> None:
        self.session_id = session_id
        self._codec = p.Codec(max_frame_bytes)
        self._outbound = _Seal(offer.key, session_id, _C2P)
        self._inbound = _Seal(offer.key, session_id, _P2C)
        self.broken: str | None = None
        self.connected = False
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        self._stream = _Stream(sock, _body_limit(max_frame_bytes))
        err = sock.connect_ex((host, offer.port))
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            self._break(LaneBroken("connect_failed", os.strerror(err)))
        elif err == 0:
            try:
                self._connected()
            except LaneBroken as exc:
                self._break(exc)

    def fileno(self) -> int:
        return self._stream.fd

    @property
    def usable(self) -> bool:
        return self.connected and self.broken is None

    @property
    def poll_flags(self) -> int:
        if not self.connected or self._stream.wants_write:
            return zmq.POLLIN | zmq.POLLOUT
        return zmq.POLLIN

    def send(self, message: p.Message) -> bool:
        """Seal and send; False if the lane is (or just became) unusable."""
        if not self.usable:
            return False
        frame = self._outbound.seal(self._codec.encode(message))
        try:
            self._stream.send(frame)
        except LaneBroken as exc:
            self._break(exc)
            return False
        return True

    def on_event(self, flags: int) -> list[p.Message]:
        """What the poll reported: finish connecting, write, read. The messages that came."""
        out: list[p.Message] = []
        if self.broken is not None:
            return out
        try:
            if not self.connected:
                if not flags & (zmq.POLLOUT | zmq.POLLERR):
                    return out
                err = self._stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise LaneBroken("connect_failed", os.strerror(err))
                self._connected()
            elif flags & zmq.POLLOUT:
                self._stream.flush()
            if not flags & (zmq.POLLIN | zmq.POLLERR):
                return out
            for body in self._stream.frames():
                plain = self._inbound.open(body)
                try:
                    message = self._codec.decode(plain)
                except p.ProtocolError as exc:
                    raise LaneBroken("malformed", str(exc)) from None
                if type(message) not in LANE_PRODUCER_TO_CONSUMER:
                    raise LaneBroken("unexpected_kind", type(message).__name__)
                out.append(message)
        except LaneBroken as exc:
            self._break(exc)  # what came before the fault is good: it opened
        return out

    def close(self) -> None:
        if self.broken is None:
            self.broken = "closed"
        self._stream.close()

    def _connected(self) -> None:
        self.connected = True
        sid = self.session_id.encode("ascii")
        self._stream.send(bytes((len(sid),)) + sid + self._outbound.seal(b""))

    def _break(self, exc: LaneBroken) -> None:
        # The socket stays open until close(): it may be in a poll on another thread,
        # and a descriptor closed under a poll can be reused by another file.
        if self.broken is None:
            self.broken = exc.reason
            log.debug("lane of session %s lost: %s", self.session_id, exc)


def lane_host(endpoint: str) -> str:
    """The host of a `tcp://host:port` endpoint (IPv6 in brackets kept bare)."""
    rest = endpoint.split("://", 1)[-1]
    host = rest.rsplit(":", 1)[0]
    return host.strip("[]")
