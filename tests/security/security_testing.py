"""Helpers for the security tests: a second authorized key, raw sockets, a wire recorder.

Test modules import these from here; conftest.py registers the fixtures.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import pytest
import zmq
from peer_testing import RAW_LINK, Keyring, RawSession

from ecshare.control import ControlClient, KeyPair, generate_keypair, load_keypair

# libzmq's greeting: signature (10 bytes), version (2), mechanism (20), as-server (1),
# filler (31). Everything after it is a sequence of frames.
GREETING_BYTES = 64
_SIGNATURE_HEAD = b"\xff"
_SIGNATURE_TAIL = b"\x7f"


@pytest.fixture(scope="session")
def rival(tmp_path_factory: pytest.TempPathFactory) -> KeyPair:
    """A second consumer key pair, authorized alongside keyring.consumer (see `both_authorized`)."""
    files = generate_keypair(tmp_path_factory.mktemp("rival-keys"), "rival")
    return load_keypair(files.secret_path)


def both_authorized(keyring: Keyring, rival: KeyPair) -> dict[str, Any]:
    """Producer config that admits both the usual consumer key and the rival's."""
    return {**keyring.producer_config(), "authorized_keys": [rival.public_text]}


def curve_dealer(
    context: zmq.Context[Any],
    address: str,
    *,
    server_public: bytes,
    client: KeyPair,
) -> zmq.Socket[bytes]:
    """A bare CURVE DEALER: sends whatever bytes a test wants, bypassing the codec."""
    sock: zmq.Socket[bytes] = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # the sender never drops: every frame must arrive
    sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, client.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, client.secret)
    sock.connect(address)
    return sock


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def producer_state(stats: Mapping[str, Any]) -> dict[str, Any]:
    """What a frame must not change: sessions and their grants, entries, pins, blocks."""
    store = stats["store"]
    return {
        "sessions": stats["sessions"],
        "grants": stats["grants"],
        "active_grants": stats["active_grants"],
        **{
            k: store[k]
            for k in (
                "entries",
                "ready",
                "allocated",
                "evicting",
                "used_blocks",
                "pins",
                "pinned_entries",
                "evictions",
            )
        },
    }


def host_port(address: str) -> tuple[str, int]:
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    return host, int(port)


# -- a recording TCP relay -----------------------------------------------------------------------


@dataclass
class WireRecorder:
    """A TCP relay in front of a producer that keeps every byte the producer sent back.

    A client connects to `address` instead of the producer's; what the producer wrote
    on each connection is kept, byte for byte, whatever the client library did with it.
    """

    target: tuple[str, int]
    from_server: list[bytearray] = field(default_factory=list)
    _listener: socket.socket = field(init=False)
    _threads: list[threading.Thread] = field(default_factory=list)
    _sockets: list[socket.socket] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._serve, daemon=True)
        self._accept.start()

    @property
    def address(self) -> str:
        return f"tcp://127.0.0.1:{self._listener.getsockname()[1]}"

    def recorded(self) -> list[bytes]:
        """What the producer sent, one item per connection."""
        with self._lock:
            return [bytes(b) for b in self.from_server]

    def close(self) -> None:
        self._listener.close()
        for sock in self._sockets:
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5)

    def _serve(self) -> None:
        # One client connection at a time is all the tests need; libzmq reconnects
        # after a refusal, and those connections are recorded too.
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=5)
            server.settimeout(None)
            self._sockets += [client, server]
            record = bytearray()
            with self._lock:
                self.from_server.append(record)
            for src, dst, into in ((client, server, None), (server, client, record)):
                thread = threading.Thread(target=self._pump, args=(src, dst, into), daemon=True)
                thread.start()
                self._threads.append(thread)

    def _pump(self, src: socket.socket, dst: socket.socket, into: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if into is not None:
                    with self._lock:
                        into += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)


@contextlib.contextmanager
def wire_recorder(address: str) -> Iterator[WireRecorder]:
    recorder = WireRecorder(host_port(address))
    try:
        yield recorder
    finally:
        recorder.close()


# -- reading what a ZMTP server sent -------------------------------------------------------------


@dataclass(frozen=True)
class ZmtpStream:
    """One connection's server-to-client bytes, split into greeting and frames."""

    mechanism: bytes  # b"" if the greeting did not arrive whole
    commands: list[bytes]  # command names, in order
    messages: int  # message (not command) frames: application data
    trailing: int  # bytes of an incomplete last frame


def parse_zmtp(data: bytes) -> ZmtpStream:
    """What one connection's server sent: its greeting, then commands and messages."""
    if data:
        assert data[:1] == _SIGNATURE_HEAD, f"not a ZMTP greeting: {data!r}"
    greeting = data[:GREETING_BYTES]
    if len(greeting) < GREETING_BYTES:
        assert greeting[9:10] in (b"", _SIGNATURE_TAIL), greeting
        return ZmtpStream(b"", [], 0, len(greeting))
    assert greeting[9:10] == _SIGNATURE_TAIL, greeting
    mechanism = greeting[12:32].rstrip(b"\x00")
    pos = GREETING_BYTES
    commands: list[bytes] = []
    messages = 0
    while pos < len(data):
        flags = data[pos]
        head = 9 if flags & 0x02 else 2  # long frames have an 8-byte size
        size = int.from_bytes(data[pos + 1 : pos + head], "big")
        body = data[pos + head : pos + head + size]
        if pos + head > len(data) or len(body) < size:
            return ZmtpStream(mechanism, commands, messages, len(data) - pos)
        if flags & 0x04:
            commands.append(body[1 : 1 + body[0]])
        else:
            messages += 1
        pos += head + size
    return ZmtpStream(mechanism, commands, messages, 0)


@pytest.fixture
def rival_session(keyring: Keyring, rival: KeyPair) -> Iterator[Any]:
    """A raw session under the rival's key: authorized, but not the victim's peer."""
    clients: list[ControlClient] = []

    def make(address: str) -> RawSession:
        client = ControlClient(
            address,
            server_public_key=keyring.producer.public,
            keys=rival,
            settings=RAW_LINK,
        )
        clients.append(client)
        return RawSession(client)

    yield make
    for client in clients:
        client.close()
