"""The serving loop survives anything a peer sends, and reconnects are seamless."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import msgspec
import pytest
import zmq
from control_testing import FAST, Keyring, ServerProcess
from zmq.utils.monitor import recv_monitor_message

from ecshare import protocol as p
from ecshare.control import ControlClient, ControlServer, LinkState, load_authorized_keys

HELLO = p.Hello(versions=[2], session_id="s-1", client_name="test-consumer", fingerprint="fp")
WELCOME = p.Welcome(
    version=1,
    session_id="s-1",
    server_name="impostor",
    lease_ms=1000,
    heartbeat_ms=200,
    max_batch_items=8,
    data_plane=p.DataPlaneInfo(kind="test", agent_name="impostor"),
)


@pytest.fixture
def context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _curve_server(
    make_server: Callable[..., ControlServer], keyring: Keyring, **kwargs: object
) -> ControlServer:
    return make_server(
        keys=keyring.server.keys,
        authorized=load_authorized_keys(keyring.authorized_file),
        **kwargs,
    )


def _raw_dealer(
    context: zmq.Context[zmq.Socket[bytes]],
    server: ControlServer,
    keyring: Keyring,
    routing_id: bytes | None = None,
) -> zmq.Socket[bytes]:
    """An authorized peer that sends whatever bytes a test wants, bypassing the codec."""
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if routing_id is not None:
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
    sock.setsockopt(zmq.CURVE_SERVERKEY, keyring.server.keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keyring.client.keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keyring.client.keys.secret)
    sock.connect(server.endpoint)
    return sock


def _drain(server: ControlServer, quiet_ms: int = 300) -> list[p.Message]:
    """Everything the server delivers until it has been quiet for `quiet_ms`."""
    delivered = []
    while (inbound := server.recv(quiet_ms)) is not None:
        delivered.append(inbound.message)
    return delivered


def test_malformed_frames_are_dropped_and_counted(
    keyring: Keyring,
    make_server: Callable[..., ControlServer],
    make_client: Callable[..., ControlClient],
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server = _curve_server(make_server, keyring)
    raw = _raw_dealer(context, server, keyring)
    raw.send(b"\xc1 not msgpack")  # garbage
    raw.send(b"")  # empty
    raw.send_multipart([p.encode(HELLO), p.encode(HELLO)])  # two frames for one message
    raw.send(msgspec.msgpack.encode({"t": "nope", "session_id": "s"}))  # unknown tag
    raw.send(p.encode(WELCOME))  # a producer's message, from a consumer
    raw.send(p.encode(HELLO))  # and finally a valid one

    first = server.recv(10_000)
    assert first is not None and first.message == HELLO
    assert first.user == keyring.client.keys.public_text
    stats = server.stats
    assert stats["dropped_malformed"] == 3
    assert stats["dropped_frame_count"] == 1
    assert stats["dropped_unexpected_kind"] == 1
    assert stats["received"] == 1

    # Each bad frame is answered, so the sender's operator can see what went wrong.
    errors: list[p.Message] = []
    while len(errors) < 5 and raw.poll(2_000):
        errors.append(p.decode(raw.recv()))
    assert len(errors) == 5
    assert all(isinstance(e, p.Error) and e.code is p.ErrorCode.BAD_MESSAGE for e in errors)
    assert stats["error_replies"] == 5

    # The server keeps serving a well-behaved client.
    client = make_client(
        server.endpoint, server_public_key=keyring.server.keys.public, keys=keyring.client.keys
    )
    client.send(p.Heartbeat(session_id="s-1"))
    inbound = server.recv(10_000)
    assert inbound is not None and inbound.message == p.Heartbeat(session_id="s-1")
    assert server.send(inbound.peer, p.HeartbeatAck())
    assert client.recv(10_000) == p.HeartbeatAck()


def test_answers_to_bad_frames_are_rate_limited(
    keyring: Keyring,
    make_server: Callable[..., ControlServer],
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server = _curve_server(make_server, keyring)
    raw = _raw_dealer(context, server, keyring)
    for _ in range(100):
        raw.send(b"\xc1")
    assert _drain(server) == []
    stats = server.stats
    assert stats["dropped_malformed"] == 100
    assert stats["error_replies"] + stats["error_replies_suppressed"] == 100
    assert 20 <= stats["error_replies"] < 100


def test_oversized_message_disconnects_sender_not_server(
    keyring: Keyring,
    make_server: Callable[..., ControlServer],
    make_client: Callable[..., ControlClient],
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server = _curve_server(make_server, keyring, settings=replace(FAST, max_frame_bytes=4096))
    raw = _raw_dealer(context, server, keyring)
    monitor = raw.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
    events = []
    deadline = time.monotonic() + 10
    while zmq.EVENT_HANDSHAKE_SUCCEEDED not in events and time.monotonic() < deadline:
        if monitor.poll(100):
            events.append(recv_monitor_message(monitor)["event"])
    raw.send(b"\x00" * 8192)
    while zmq.EVENT_DISCONNECTED not in events and time.monotonic() < deadline:
        if monitor.poll(100):
            events.append(recv_monitor_message(monitor)["event"])
    assert zmq.EVENT_DISCONNECTED in events, "libzmq should cut a peer over MAXMSGSIZE"
    raw.disable_monitor()
    monitor.close(0)

    assert server.recv(200) is None
    assert server.stats["received"] == 0
    assert server.stats["disconnected"] >= 1

    client = make_client(
        server.endpoint,
        server_public_key=keyring.server.keys.public,
        keys=keyring.client.keys,
        settings=replace(FAST, max_frame_bytes=4096),
    )
    # Our own client refuses to send what the server would cut it off for.
    huge = p.FetchRequest(
        session_id="s-1",
        request_id="r-1",
        items=[p.ItemRequest(mm_hash=f"{i:0>200}") for i in range(100)],
    )
    with pytest.raises(p.ProtocolError, match="frame limit"):
        client.send(huge)
    client.send(HELLO)
    inbound = server.recv(10_000)
    assert inbound is not None and inbound.message == HELLO


def test_send_to_unknown_peer_is_counted_not_raised(
    keyring: Keyring, make_server: Callable[..., ControlServer]
) -> None:
    server = _curve_server(make_server, keyring)
    assert server.send(b"\x01nobody", p.HeartbeatAck()) is False
    assert server.stats["send_dropped_unreachable"] == 1


def test_reconnecting_client_takes_over_its_routing_id(
    keyring: Keyring,
    make_server: Callable[..., ControlServer],
    context: zmq.Context[zmq.Socket[bytes]],
) -> None:
    server = _curve_server(make_server, keyring)
    routing_id = b"\x01consumer-a"
    old = _raw_dealer(context, server, keyring, routing_id=routing_id)
    old.send(p.encode(HELLO))
    first = server.recv(10_000)
    assert first is not None and first.peer == routing_id

    # The same consumer on a new connection (its old one not yet noticed as dead).
    new = _raw_dealer(context, server, keyring, routing_id=routing_id)
    new.send(p.encode(HELLO))
    second = server.recv(10_000)
    assert second is not None and second.peer == routing_id
    assert server.send(routing_id, p.HeartbeatAck())
    assert new.poll(5_000)
    assert p.decode(new.recv()) == p.HeartbeatAck()
    assert not old.poll(200)


def test_client_reconnects_after_server_restart(
    keyring: Keyring,
    spawn_server: Callable[..., ServerProcess],
    make_client: Callable[..., ControlClient],
) -> None:
    args = (
        "--secret-file",
        str(keyring.server.files.secret_path),
        "--authorized",
        str(keyring.authorized_file),
    )
    producer = spawn_server(*args)
    client = make_client(
        producer.endpoint,
        server_public_key=keyring.server.keys.public,
        keys=keyring.client.keys,
        reconnect_ivl_s=0.05,
        reconnect_ivl_max_s=0.2,
    )
    client.send(HELLO)
    assert isinstance(client.recv(10_000), p.Welcome)
    assert client.wait_ready(5_000)  # the state comes from a monitor thread, which may lag
    assert client.state is LinkState.READY

    producer.kill()
    deadline = time.monotonic() + 10
    while client.state is not LinkState.DISCONNECTED and time.monotonic() < deadline:
        client.recv(50)
    assert client.state is LinkState.DISCONNECTED

    # Sent while the producer is down: queued, and delivered after the restart.
    client.send(p.Hello(versions=[2], session_id="s-2", client_name="c", fingerprint="fp"))
    spawn_server(*args, "--port", str(producer.port))
    welcome = client.recv(10_000)
    assert isinstance(welcome, p.Welcome) and welcome.session_id == "s-2"
    assert client.wait_ready(5_000)  # the state comes from a monitor thread, which may lag
    assert client.state is LinkState.READY
    assert client.stats["handshake_succeeded"] == 2


def test_handshake_flood_does_not_freeze_the_server(
    keyring: Keyring,
    make_server: Callable[..., ControlServer],
    make_client: Callable[..., ControlClient],
) -> None:
    # Every failed handshake is a monitor event; unread, a few thousand of them used
    # to block libzmq's I/O thread. Nobody reads the server here until the end.
    server = _curve_server(make_server, keyring)
    greeting = b"\xff" + bytes(8) + b"\x7f\x03\x00NULL" + bytes(48)
    for _ in range(3000):
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as raw:
            raw.sendall(greeting)
    client = make_client(
        server.endpoint, server_public_key=keyring.server.keys.public, keys=keyring.client.keys
    )
    assert client.wait_ready(10_000)
    client.send(HELLO)
    inbound = server.recv(10_000)
    assert inbound is not None and inbound.message == HELLO
    deadline = time.monotonic() + 10
    while server.stats["handshake_failed_protocol"] < 3000 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.stats["handshake_failed_protocol"] == 3000


def test_closing_server_and_client_releases_the_context(keyring: Keyring) -> None:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    server = ControlServer(
        keys=keyring.server.keys,
        authorized=load_authorized_keys(keyring.authorized_file),
        context=context,
        settings=FAST,
    )
    client = ControlClient(
        server.endpoint,
        server_public_key=keyring.server.keys.public,
        keys=keyring.client.keys,
        context=context,
        settings=FAST,
    )
    assert client.wait_ready(10_000)
    client.close()
    server.close()
    server.close()  # idempotent
    # term() waits for every socket of the context: the ZAP handler's and the
    # monitor thread's included.
    terminator = threading.Thread(target=context.term, daemon=True)
    terminator.start()
    terminator.join(timeout=10)
    assert not terminator.is_alive(), "a socket of the control plane was left open"
