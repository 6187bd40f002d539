"""libzmq faults a peer's connection can drive the producer's ROUTER into.

libzmq 4.3.5 (what pyzmq 27.3.0, the newest on PyPI, bundles; no libzmq release
has a fix) aborts with ``Assertion failed: !_io_error
(src/stream_engine_base.cpp:310)``, zeromq/libzmq#4841, when a connection's
engine has stopped reading and then sees an I/O error, and its ZMTP heartbeat
timer fires afterwards:

- ``in_event_internal`` (stream_engine_base.cpp:247) finds ``_input_stopped``,
  removes the fd and sets ``_io_error``, but leaves the engine and its timers;
- ``timer_event(heartbeat_ivl_timer_id)`` (:735) calls ``out_event()``, which
  asserts ``!_io_error`` (:310) instead of returning, as ``restart_output`` does.

A ROUTER_HANDOVER makes the first half easy: a consumer that reconnects with its
routing id takes its pipe over, and the superseded connection's engine lives on
without a pipe (``session_base_t::pipe_terminated`` keeps the engine of a
non-raw socket), so anything that still arrives on it cannot be pushed
(``push_msg``: EAGAIN) and stops its input; a reset of that connection is the
I/O error. The chaos harness's ``delay_control`` fault does all three: it holds
a connection's bytes back until the consumer gives up on it and reconnects,
delivers them late, and aborts the connection.

The producer therefore sends no ZMTP PINGs (``LinkSettings.apply(sends_pings=
False)``), which leaves no heartbeat timer to fire; it still answers the
consumer's PINGs, whose TTL makes it drop a consumer that goes silent.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

import pytest
import zmq
from control_testing import FAST, Keyring, ServerProcess, start_peer

from ecshare import protocol as p
from ecshare.control import ControlClient, ControlServer, LinkState, load_authorized_keys

HELLO = p.Hello(versions=[2], session_id="s-1", client_name="test-consumer", fingerprint="fp")
ROUTING_ID = b"\x01consumer-x"
pytestmark = pytest.mark.timeout(60)


class _Proxy:
    """Forwards one TCP connection at a time and can reset its server side."""

    def __init__(self, target_port: int) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        self._upstream: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self._listener.accept()
            except OSError:
                return
            up = socket.create_connection(("127.0.0.1", self._target))
            self._upstream.append(up)
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass

    def reset_server_side(self) -> None:
        """Abort every connection to the server with a RST (SO_LINGER 0)."""
        for up in self._upstream:
            up.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            up.close()

    def close(self) -> None:
        self._listener.close()
        for up in self._upstream:
            up.close()


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _dealer(
    context: zmq.Context[zmq.Socket[bytes]], endpoint: str, keyring: Keyring
) -> zmq.Socket[bytes]:
    """An authorized consumer's socket with a fixed routing id, bypassing the codec."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, ROUTING_ID)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keyring.server.keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keyring.client.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keyring.client.keys.secret)
    sock.connect(endpoint)
    return sock


def _welcomed(sock: zmq.Socket[bytes]) -> bool:
    sock.send(p.encode(HELLO))
    return bool(sock.poll(10_000)) and isinstance(p.decode(sock.recv()), p.Welcome)


def test_producer_survives_a_reset_of_a_superseded_connection(
    keyring: Keyring,
    spawn_server: Callable[..., ServerProcess],
    make_client: Callable[..., ControlClient],
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    producer = spawn_server(
        "--secret-file",
        str(keyring.server.files.secret_path),
        "--authorized",
        str(keyring.authorized_file),
    )
    proxy = _Proxy(producer.port)
    try:
        old = _dealer(context, f"tcp://127.0.0.1:{proxy.port}", keyring)
        assert _welcomed(old)
        # The consumer again, on a new connection: it takes the routing id over,
        # and the old connection's engine is left without a pipe.
        new = _dealer(context, producer.endpoint, keyring)
        assert _welcomed(new)
        old.send(p.encode(HELLO))  # cannot be pushed: that engine stops reading
        time.sleep(0.3)
        proxy.reset_server_side()  # the I/O error
        # Several of the producer's heartbeat intervals.
        time.sleep(5 * FAST.heartbeat_ivl_s)
        code = producer.process.poll()
        producer.errors.seek(0)
        assert code is None, f"the producer died ({code}): {producer.errors.read()[-500:]}"
    finally:
        proxy.close()

    # It still serves, and the consumer's new connection still works.
    assert _welcomed(new)
    client = make_client(
        producer.endpoint, server_public_key=keyring.server.keys.public, keys=keyring.client.keys
    )
    client.send(HELLO)
    assert isinstance(client.recv(10_000), p.Welcome)
    # The state comes from a monitor thread, which may lag the first reply.
    assert client.wait_ready(5_000)
    assert client.state is LinkState.READY


def test_producer_still_drops_a_consumer_that_goes_silent(
    keyring: Keyring, make_server: Callable[..., ControlServer]
) -> None:
    """Without PINGs of its own, the producer relies on the TTL of the consumer's.

    A consumer stopped before its first PING (within one heartbeat interval of
    its handshake) leaves no TTL behind: its connection stays until it resumes
    or dies. Its grants do not wait for that: they end with its session's lease.
    """
    server = make_server(
        keys=keyring.server.keys, authorized=load_authorized_keys(keyring.authorized_file)
    )
    consumer = _spawn_consumer(server.endpoint, keyring)
    try:
        deadline = time.monotonic() + 10
        while server.stats["handshake_succeeded"] < 1:
            assert time.monotonic() < deadline, "the consumer never connected"
            server.recv(50)
        # Its PINGs, which carry the TTL, have begun.
        time.sleep(3 * FAST.heartbeat_ivl_s)
        os.kill(consumer.pid, signal.SIGSTOP)  # silent, its connection still open
        stopped = time.monotonic()
        while server.stats["disconnected"] < 1:
            server.recv(50)
            assert time.monotonic() - stopped < FAST.heartbeat_timeout_s + 2, (
                "the producer never dropped a consumer that stopped sending heartbeats"
            )
    finally:
        consumer.kill()
        consumer.wait(10)


def _spawn_consumer(endpoint: str, keyring: Keyring) -> subprocess.Popen[str]:
    """A consumer process that says Hello and waits, heartbeating, for a reply."""
    return start_peer(
        "call",
        "--endpoint",
        endpoint,
        "--server-key",
        str(keyring.server.files.public_path),
        "--secret-file",
        str(keyring.client.files.secret_path),
        "--timeout-ms",
        "30000",
    )
