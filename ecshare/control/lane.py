"""The fetch lane: a TLS 1.3 side channel for a session's hot messages.

Why it exists (measured on 2 vCPUs, two processes, a 5 ms idle gap between
round trips of 200-byte messages): a ZMQ CURVE DEALER/ROUTER round trip takes
0.50 to 0.59 ms at p50, because each message crosses the sender's and the
receiver's ZMQ I/O threads and each of those wakes from idle; a plain TCP round
trip between the same two threads takes 0.15 to 0.18 ms. A sporadic fetch pays
one such round trip, so its requests and their answers go here when the
producer offers a lane.

ZMQ stays the session's authority: the CURVE handshake and the allow-list admit
the consumer, Hello/Welcome open the session, heartbeats, pushes, Bye and status
stay there. The producer's `Welcome` (CURVE-encrypted) offers a lane: a TCP port
beside its ROUTER, the SHA-256 of the lane server's certificate (a self-signed
P-256 certificate made when the server starts, its key never written in the
clear), and a fresh random 32-byte key for this session only, so only the
authenticated consumer that opened the session learns it.

The construction is TLS 1.3 (Python's `ssl`, OpenSSL, over `ssl.MemoryBIO` so
that the producer's poll loop owns the sockets), not framing of our own:

    consumer -> producer: TLS 1.3 handshake; the consumer checks the server's
                          certificate against the SHA-256 in the Welcome before
                          it sends anything but the handshake, then, inside
                          TLS, the bind frame: sid_len:u8 sid key:32
    every frame after it, both ways, inside TLS:  length:u32be message

Every connection runs a full handshake with fresh ephemeral keys on both sides
(no tickets, no resumption, no 0-RTT), so no two connections share traffic keys
and TLS's record sequence numbers never repeat a (key, nonce) pair. A captured
connection replayed on a new one fails the handshake (the producer's half of it
is new), and a replayed, reordered, reflected or altered record fails its tag.
The producer binds a connection to a session, and only then closes that
session's earlier lane, when the bind frame names the session's key (compared
in constant time): an unproven connection never disturbs the live lane. Before
that proof the producer sends only its TLS handshake flight (the certificate
and the handshake's own messages), nothing of any session (invariant 5). It
holds at most `MAX_UNBOUND` unproven connections, each for `bind_timeout_s`,
and takes no frame over the frame limit. Anything wrong is a counted drop and a
closed lane, never an exception out of here: the consumer then goes on over ZMQ.

Chosen over a key schedule of our own because its cost is near that of the
framing it replaced (ChaCha20-Poly1305 under one key per session, no handshake):
on 2 loaded vCPUs, a lane round trip 5 ms after the last took 329 us at p50
against 327 (paired difference +23 us, from -47 to +91 over 8 interleaved
rounds), sealing and opening one in memory 4.7 us against 4.2, and a handshake
about 0.7 ms of CPU once per connection. As for any TLS client, SSLKEYLOGFILE
(when set) names a file that gets each connection's secrets.

The messages inside are `ecshare.protocol` messages, encoded as on ZMQ; only
the kinds in `LANE_CONSUMER_TO_PRODUCER` and `LANE_PRODUCER_TO_CONSUMER` travel
here, and each names the lane's own session.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import hashlib
import hmac
import logging
import os
import secrets
import socket
import ssl
import struct
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Final

import zmq
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from ecshare import protocol as p
from ecshare.control.errors import ControlConfigError

log = logging.getLogger(__name__)

KEY_BYTES: Final = 32
# Connections accepted whose bind frame has not come yet; more are closed at once.
MAX_UNBOUND: Final = 64
LANE_CONSUMER_TO_PRODUCER: Final[frozenset[type]] = frozenset({p.FetchRequest, p.Release})
LANE_PRODUCER_TO_CONSUMER: Final[frozenset[type]] = frozenset({p.FetchReply, p.Released, p.Error})

_HEAD = struct.Struct(">I")
_MAX_SID: Final = 128
_MAX_BIND: Final = 1 + _MAX_SID + KEY_BYTES
# recv() allocates its whole size each call: 256 KiB cost 30 us against 4 for 64 KiB.
_RECV_CHUNK: Final = 64 * 1024
# Frames a lane may hold unsent (a peer that stops reading) before it is closed.
_MAX_UNSENT_FRAMES: Final = 4
# TLS adds a header and a tag per record of at most 16 KiB.
_TLS_SLACK: Final = 1024

DROP_REASONS: Final = (
    "bind_timeout",  # no handshake and bind frame in time
    "handshake",  # the TLS handshake failed: not TLS, or a replayed or forged one
    "bad_bind",  # a first frame that is not a bind frame
    "unknown_session",  # bind for a session with no lane offered
    "bad_key",  # the bind frame does not name the session's key
    "forged",  # a record that does not open: altered, replayed, reordered
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
    """The lane is unusable; `reason` is one of DROP_REASONS, or a client's own
    ("eof", "error", "connect_failed", "bad_certificate", "no_certificate")."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def _tls_context(purpose: int) -> ssl.SSLContext:
    context = ssl.SSLContext(purpose)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    keylog = os.environ.get("SSLKEYLOGFILE")
    if keylog:
        context.keylog_filename = keylog
    return context


@functools.cache
def _client_context(_keylog: str | None) -> ssl.SSLContext:
    """The consumers' TLS context (one per SSLKEYLOGFILE value): the server is
    authenticated by the certificate digest pinned from the Welcome, not by a CA."""
    context = _tls_context(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def _server_identity() -> tuple[ssl.SSLContext, bytes]:
    """A TLS server context with a fresh self-signed certificate, and its SHA-256."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ecshare lane")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=1))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .sign(key, hashes.SHA256())
    )
    der = cert.public_bytes(serialization.Encoding.DER)
    # ssl loads a key only from a file: it is written encrypted, under a password
    # that never leaves this process, and removed once loaded.
    password = secrets.token_bytes(32)
    context = _tls_context(ssl.PROTOCOL_TLS_SERVER)
    context.num_tickets = 0  # no resumption: every connection a full handshake
    with tempfile.TemporaryDirectory(prefix="ecshare-lane-") as tmp:
        cert_path, key_path = Path(tmp, "cert.pem"), Path(tmp, "key.pem")
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        key_path.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.BestAvailableEncryption(password),
            )
        )
        context.load_cert_chain(cert_path, key_path, password=password)
    return context, hashlib.sha256(der).digest()


class _Stream:
    """A non-blocking TCP connection carrying TLS: whole frames in, frames out."""

    def __init__(
        self,
        sock: socket.socket,
        context: ssl.SSLContext,
        *,
        server_side: bool,
        max_body: int,
    ) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.fd = sock.fileno()
        self.max_body = max_body
        self._from_net = ssl.MemoryBIO()
        self._to_net = ssl.MemoryBIO()
        self.tls = context.wrap_bio(self._from_net, self._to_net, server_side=server_side)
        self.secure = False  # the handshake has completed
        self._eof = False
        self._in = bytearray()  # plaintext not yet framed
        self._out = bytearray()  # ciphertext not yet sent
        self.closed = False

    @property
    def wants_write(self) -> bool:
        return bool(self._out)

    def handshake(self) -> bool:
        """Read what has come and advance the handshake; True once it is complete."""
        self._pull()
        try:
            self.tls.do_handshake()
        except ssl.SSLWantReadError:
            self.flush()
            if self._eof:
                raise LaneBroken("eof", "closed during the handshake") from None
            return False
        except ssl.SSLError as exc:
            raise LaneBroken("handshake", str(exc)) from None
        self.secure = True
        self.flush()
        return True

    def frames(self, limit: int | None = None) -> Iterator[bytes]:
        """Read what has arrived and yield each whole frame's body; raises LaneBroken."""
        limit = self.max_body if limit is None else limit
        self._pull()
        self._decrypt()
        while len(self._in) >= _HEAD.size:
            (n,) = _HEAD.unpack_from(self._in)
            if n > limit:
                raise LaneBroken("oversized", f"frame of {n} bytes, limit {limit}")
            if len(self._in) < _HEAD.size + n:
                break
            body = bytes(self._in[_HEAD.size : _HEAD.size + n])
            del self._in[: _HEAD.size + n]
            yield body
            limit = self.max_body  # only the first frame has a limit of its own
        if self._eof:
            if self._in:
                raise LaneBroken("truncated", f"{len(self._in)} bytes of a frame, then EOF")
            raise LaneBroken("eof")

    def send(self, body: bytes) -> None:
        """Seal one frame, queue it and write what the socket takes; raises LaneBroken."""
        if len(self._out) > _MAX_UNSENT_FRAMES * (self.max_body + _TLS_SLACK):
            raise LaneBroken("send_overflow", f"{len(self._out)} bytes unsent")
        try:
            self.tls.write(_HEAD.pack(len(body)) + body)
        except ssl.SSLError as exc:
            raise LaneBroken("error", str(exc)) from None
        self.flush()

    def flush(self) -> None:
        self._out += self._to_net.read()
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

    def _pull(self) -> None:
        """Move what the socket holds into TLS; note the end of the stream."""
        while not self._eof:
            try:
                data = self.sock.recv(_RECV_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                raise LaneBroken("error", str(exc)) from None
            if not data:
                self._eof = True
                return
            self._from_net.write(data)
            if len(data) < _RECV_CHUNK:
                return

    def _decrypt(self) -> None:
        # Asking for no more than the bytes at hand spares read() a large allocation
        # per call, and stopping when none are left spares it raising SSLWantReadError.
        while n := self._from_net.pending + self.tls.pending():
            try:
                plain = self.tls.read(n)
            except ssl.SSLWantReadError:  # part of a record: the rest comes later
                return
            except ssl.SSLZeroReturnError:
                self._eof = True
                return
            except ssl.SSLError as exc:
                raise LaneBroken("forged", str(exc)) from None
            if not plain:
                return
            self._in += plain


def _body_limit(max_frame_bytes: int) -> int:
    return max(max_frame_bytes, _MAX_BIND)


# -- the producer's end ---------------------------------------------------------------------


class _Bound:
    __slots__ = ("session_id", "stream")

    def __init__(self, stream: _Stream, session_id: str) -> None:
        self.stream = stream
        self.session_id = session_id


class LaneServer:
    """The producer's lanes: one listening socket, the keys it offered, the connections.

    Use from the producer's network thread. It registers its descriptors with the
    `zmq.Poller` it is given; pass each poll's events to `receive`. `port` 0 takes
    a free port; any other that cannot be bound raises ControlConfigError.
    """

    def __init__(
        self,
        *,
        host: str,
        poller: zmq.Poller,
        max_frame_bytes: int,
        bind_timeout_s: float,
        port: int = 0,
        name: str = "ecshare lane server",
    ) -> None:
        self._poller = poller
        self._codec = p.Codec(max_frame_bytes)
        self._max_body = _body_limit(max_frame_bytes)
        self._bind_timeout_s = bind_timeout_s
        self.name = name
        self.stats: dict[str, int] = dict.fromkeys(STAT_NAMES, 0)
        self._context, self._cert_sha256 = _server_identity()
        self._keys: dict[str, bytes] = {}  # session id -> the key offered for it
        self._unbound: dict[int, tuple[_Stream, float]] = {}  # fd -> (stream, deadline)
        self._bound: dict[int, _Bound] = {}  # fd -> lane
        self._by_session: dict[str, _Bound] = {}
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                listener.bind((host.strip("[]"), port))
            except OSError as exc:
                if not port:
                    raise
                raise ControlConfigError(
                    f"{name}: cannot bind the fetch lane to {host} port {port} "
                    f"(lane_port): {exc.strerror or exc}"
                ) from None
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
        return p.LaneOffer(port=self.port, key=key, cert_sha256=self._cert_sha256)

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
                    self._flush(lane.stream)
                if flags & (zmq.POLLIN | zmq.POLLERR) and fd in self._bound:
                    self._read(lane, out)
            elif fd in self._unbound:
                stream = self._unbound[fd][0]
                if flags & zmq.POLLOUT:
                    self._flush(stream)
                if flags & (zmq.POLLIN | zmq.POLLERR) and fd in self._unbound:
                    self._bind(stream, out)
        return out

    def send(self, session_id: str, message: p.Message) -> bool:
        """Seal and send `message` on the session's lane; False if it has none (or lost it)."""
        lane = self._by_session.get(session_id)
        if lane is None:
            return False
        try:
            lane.stream.send(self._codec.encode(message))
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
            stream = _Stream(sock, self._context, server_side=True, max_body=self._max_body)
            self._unbound[stream.fd] = (stream, time.monotonic() + self._bind_timeout_s)
            self._poller.register(stream.fd, zmq.POLLIN)

    def _bind(self, stream: _Stream, out: list[tuple[str, p.Message]]) -> None:
        try:
            if not stream.secure and not stream.handshake():
                self._want_write(stream)
                return
            frames = stream.frames(limit=_MAX_BIND)
            body = next(frames, None)
            if body is None:
                self._want_write(stream)
                return
            sid_len = body[0] if body else 0
            if not 0 < sid_len <= _MAX_SID or len(body) != 1 + sid_len + KEY_BYTES:
                raise LaneBroken("bad_bind", "not sid_len, sid, key")
            try:
                session_id = body[1 : 1 + sid_len].decode("ascii")
            except UnicodeDecodeError:
                raise LaneBroken("bad_bind", "session id not ascii") from None
            key = self._keys.get(session_id)
            if key is None:
                raise LaneBroken("unknown_session")
            if not hmac.compare_digest(key, body[1 + sid_len :]):
                raise LaneBroken("bad_key")
        except LaneBroken as exc:
            # A stranger that connects and leaves without a word is a bad bind too.
            unbound = LaneBroken("bad_bind", str(exc)) if exc.reason in ("eof", "error") else exc
            self._drop(stream, unbound)
            return
        del self._unbound[stream.fd]
        old = self._by_session.get(session_id)
        if old is not None:
            self._close(old.stream)  # the session's consumer proved the key on a new one
        lane = _Bound(stream, session_id)
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
            for plain in frames:
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

    def _flush(self, stream: _Stream) -> None:
        try:
            stream.flush()
        except LaneBroken as exc:
            self._drop(stream, exc)
            return
        self._want_write(stream)

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
    with what the poll said. `connected` once the TLS handshake has completed with
    the pinned certificate and the bind frame is queued (frames sent after it follow
    it), `usable` while that holds; `broken` says why it is not, after which nothing
    here is used again.
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
        self._offer = offer
        self.broken: str | None = None
        self.connected = False
        self._tcp_up = False
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        context = _client_context(os.environ.get("SSLKEYLOGFILE"))
        self._stream = _Stream(
            sock, context, server_side=False, max_body=_body_limit(max_frame_bytes)
        )
        if offer.cert_sha256 is None:
            self._break(LaneBroken("no_certificate", "an offer of an earlier release"))
            return
        err = sock.connect_ex((host, offer.port))
        if err not in (0, errno.EINPROGRESS, errno.EAGAIN, errno.EWOULDBLOCK):
            self._break(LaneBroken("connect_failed", os.strerror(err)))
        elif err == 0:
            try:
                self._tcp_connected()
            except LaneBroken as exc:
                self._break(exc)

    def fileno(self) -> int:
        return self._stream.fd

    @property
    def usable(self) -> bool:
        return self.connected and self.broken is None

    @property
    def poll_flags(self) -> int:
        if not self._tcp_up or self._stream.wants_write:
            return zmq.POLLIN | zmq.POLLOUT
        return zmq.POLLIN

    def send(self, message: p.Message) -> bool:
        """Seal and send; False if the lane is (or just became) unusable."""
        if not self.usable:
            return False
        try:
            self._stream.send(self._codec.encode(message))
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
            if not self._tcp_up:
                if not flags & (zmq.POLLOUT | zmq.POLLERR):
                    return out
                err = self._stream.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err:
                    raise LaneBroken("connect_failed", os.strerror(err))
                self._tcp_connected()
            elif flags & zmq.POLLOUT:
                self._stream.flush()
            if not flags & (zmq.POLLIN | zmq.POLLERR):
                return out
            if not self.connected:
                if not self._stream.handshake():
                    return out
                self._bind()
            for plain in self._stream.frames():
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

    def _tcp_connected(self) -> None:
        self._tcp_up = True
        self._stream.handshake()  # sends the ClientHello

    def _bind(self) -> None:
        """The handshake is done: check it was with the producer, then prove the key."""
        cert = self._stream.tls.getpeercert(binary_form=True) or b""
        pinned = self._offer.cert_sha256 or b""
        if not hmac.compare_digest(hashlib.sha256(cert).digest(), pinned):
            raise LaneBroken("bad_certificate", "not the certificate the Welcome named")
        sid = self.session_id.encode("ascii")
        self._stream.send(bytes((len(sid),)) + sid + self._offer.key)
        self.connected = True

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
