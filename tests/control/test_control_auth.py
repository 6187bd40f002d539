"""Who may talk to a producer: CURVE with an allow-list, across real processes."""

from __future__ import annotations

import logging
from collections.abc import Callable

import pytest
from control_testing import Keyring, ServerProcess, finish_peer, run_peer, start_peer

from ecshare import protocol as p
from ecshare.control import (
    AuthenticationFailed,
    ControlClient,
    ControlConfigError,
    ControlServer,
    LinkState,
    load_authorized_keys,
)

HELLO = p.Hello(versions=[2], session_id="s-1", client_name="test-consumer", fingerprint="fp")


def _curve_server(make_server: Callable[..., ControlServer], keyring: Keyring) -> ControlServer:
    return make_server(
        keys=keyring.server.keys, authorized=load_authorized_keys(keyring.authorized_file)
    )


def test_authenticated_client_round_trip(
    keyring: Keyring,
    spawn_server: Callable[..., ServerProcess],
    make_client: Callable[..., ControlClient],
) -> None:
    producer = spawn_server(
        "--secret-file",
        str(keyring.server.files.secret_path),
        "--authorized",
        str(keyring.authorized_file),
    )
    client = make_client(
        producer.endpoint, server_public_key=keyring.server.keys.public, keys=keyring.client.keys
    )
    assert client.send(HELLO)
    welcome = client.recv(10_000)
    assert isinstance(welcome, p.Welcome)
    assert welcome.session_id == "s-1"
    # The producer echoes the User-Id libzmq attached to our message: our public key,
    # which is what sessions get bound to.
    assert welcome.server_name == keyring.client.keys.public_text
    # The state comes from a monitor thread, which may lag the first reply.
    assert client.wait_ready(5_000)
    assert client.state is LinkState.READY
    assert client.send(p.Heartbeat(session_id="s-1"))
    assert client.recv(5_000) == p.HeartbeatAck()


def test_server_sees_client_key_as_user_id(
    keyring: Keyring, make_server: Callable[..., ControlServer]
) -> None:
    server = _curve_server(make_server, keyring)
    consumer = start_peer(
        "call",
        "--endpoint",
        server.endpoint,
        f"--server-key={keyring.server.files.public_path!s}",
        "--secret-file",
        str(keyring.client.files.secret_path),
    )
    inbound = server.recv(15_000)
    assert inbound is not None
    assert inbound.user == keyring.client.keys.public_text
    assert isinstance(inbound.message, p.Hello)
    server.send(inbound.peer, p.HeartbeatAck())
    result = finish_peer(consumer)
    assert result["reply"] == {"t": "pong"}
    assert result["state"] == LinkState.READY.value
    assert server.stats["auth_accepted"] == 1


def test_client_without_key_learns_nothing(
    keyring: Keyring, make_server: Callable[..., ControlServer]
) -> None:
    server = _curve_server(make_server, keyring)
    # A plain ZMQ DEALER (NULL mechanism, no ecshare code) in another process.
    result = run_peer("raw", "--endpoint", server.endpoint, "--timeout-ms", "800")
    assert result == {"frames": 0}
    assert server.recv(100) is None
    stats = server.stats
    assert stats["received"] == 0
    assert stats["handshake_failed_protocol"] + stats["handshake_failed_no_detail"] >= 1


def test_client_not_on_allow_list_is_refused_with_clear_error(
    keyring: Keyring, make_server: Callable[..., ControlServer]
) -> None:
    server = _curve_server(make_server, keyring)
    result = run_peer(
        "call",
        "--endpoint",
        server.endpoint,
        f"--server-key={keyring.server.keys.public_text}",
        "--secret-file",
        str(keyring.stranger.files.secret_path),
    )
    assert result["state"] == LinkState.AUTH_FAILED.value
    assert result["reply"] is None
    error = result["error"]
    assert error is not None
    assert f"producer at {server.endpoint} rejected this consumer's CURVE key" in error
    assert keyring.stranger.keys.public_text in error
    assert "not on the producer's allow-list" in error
    assert server.recv(200) is None
    stats = server.stats
    assert stats["received"] == 0
    assert stats["auth_rejected"] >= 1
    assert stats["auth_accepted"] == 0


def test_wrong_server_key_is_a_clear_error(
    keyring: Keyring, make_server: Callable[..., ControlServer]
) -> None:
    server = _curve_server(make_server, keyring)
    result = run_peer(
        "call",
        "--endpoint",
        server.endpoint,
        # A valid key, but the stranger's rather than the producer's.
        f"--server-key={keyring.stranger.keys.public_text}",
        "--secret-file",
        str(keyring.client.files.secret_path),
    )
    assert result["state"] == LinkState.AUTH_FAILED.value
    assert result["reply"] is None
    error = result["error"]
    assert error is not None
    assert f"producer at {server.endpoint}" in error
    assert "server public key" in error
    assert keyring.stranger.keys.public_text in error
    assert server.recv(200) is None
    assert server.stats["received"] == 0
    assert server.stats["handshake_failed_protocol"] >= 1


def test_insecure_mode_only_when_configured(
    keyring: Keyring,
    make_server: Callable[..., ControlServer],
    make_client: Callable[..., ControlClient],
    spawn_server: Callable[..., ServerProcess],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Never implied: leaving out keys is an error, not a silent downgrade.
    with pytest.raises(ControlConfigError, match="insecure=True"):
        ControlServer(keys=None)
    with pytest.raises(ControlConfigError, match="insecure=True"):
        ControlClient("tcp://127.0.0.1:1", server_public_key=None, keys=None)
    with pytest.raises(ControlConfigError, match="choose one"):
        ControlServer(keys=keyring.server.keys, insecure=True)

    with caplog.at_level(logging.WARNING, logger="ecshare.control"):
        insecure = make_server(keys=None, insecure=True)
    assert any(
        r.levelno == logging.WARNING
        and "NOT authenticated" in r.getMessage()
        and insecure.endpoint in r.getMessage()
        for r in caplog.records
    )
    secure = _curve_server(make_server, keyring)

    # Insecure on both ends, explicitly: works, and the server sees no identity.
    insecure_producer = spawn_server("--insecure")
    with caplog.at_level(logging.WARNING, logger="ecshare.control"):
        client = make_client(
            insecure_producer.endpoint, server_public_key=None, keys=None, insecure=True
        )
    assert any("NOT authenticated" in r.getMessage() for r in caplog.records)
    client.send(HELLO)
    welcome = client.recv(10_000)
    assert isinstance(welcome, p.Welcome) and welcome.server_name == "anonymous"

    # A CURVE client will not talk to an insecure server...
    result = run_peer(
        "call",
        "--endpoint",
        insecure.endpoint,
        f"--server-key={keyring.server.keys.public_text}",
        "--secret-file",
        str(keyring.client.files.secret_path),
    )
    assert result["state"] == LinkState.AUTH_FAILED.value
    # libzmq names the mismatch or just closes, depending on which side reads the
    # other's greeting first; either way the message points at insecure=True.
    assert "insecure=True" in result["error"]
    # ...and an insecure client cannot talk to a CURVE server.
    result = run_peer("call", "--endpoint", secure.endpoint, "--insecure")
    assert result["state"] == LinkState.AUTH_FAILED.value
    assert "requires CURVE" in result["error"]
    assert insecure.recv(100) is None
    assert secure.recv(100) is None
    assert insecure.stats["received"] == 0
    assert secure.stats["received"] == 0


def test_two_servers_in_one_context_keep_their_own_allow_lists(
    keyring: Keyring,
    make_server: Callable[..., ControlServer],
    make_client: Callable[..., ControlClient],
) -> None:
    for_client = make_server(keys=keyring.server.keys, authorized={keyring.client.keys.public})
    for_stranger = make_server(keys=keyring.server.keys, authorized={keyring.stranger.keys.public})
    admitted = make_client(
        for_client.endpoint, server_public_key=keyring.server.keys.public, keys=keyring.client.keys
    )
    refused = make_client(
        for_stranger.endpoint,
        server_public_key=keyring.server.keys.public,
        keys=keyring.client.keys,
    )
    assert admitted.wait_ready(10_000)
    with pytest.raises(AuthenticationFailed, match="not on the producer's allow-list"):
        refused.wait_ready(10_000)
    assert refused.state is LinkState.AUTH_FAILED
    assert for_client.stats["auth_accepted"] == 1 and for_client.stats["auth_rejected"] == 0
    assert for_stranger.stats["auth_accepted"] == 0 and for_stranger.stats["auth_rejected"] == 1


def test_a_handler_registered_right_after_the_last_one_went_finds_the_endpoint_free() -> None:
    """The ZAP handler of a context goes with its last registration, and the next one
    starts a new handler at once (a producer restarted in the same process). The old
    handler's endpoint must be free by then: closed alone, libzmq freed it only when it
    reaped the socket, and this loop failed as "already served" in 3 runs of 3."""
    import zmq

    from ecshare.control.auth import AllowList, register_allow_list

    context = zmq.Context()
    try:
        for _ in range(1000):
            register_allow_list(context, AllowList(frozenset(), server="s")).close()
    finally:
        context.term()
