"""A consumer keeps one control connection per producer, and can drop one."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from control_testing import FAST, Keyring

from ecshare import protocol as p
from ecshare.control import (
    ClientPool,
    ControlConfigError,
    ControlServer,
    KeyPair,
    load_authorized_keys,
)


def _pool(keyring: Keyring, server_public_key: bytes | None = None) -> ClientPool:
    return ClientPool(
        keys=keyring.client.keys,
        server_public_key=server_public_key,
        settings=FAST,
    )


def test_pool_keeps_one_client_per_endpoint_and_it_works(
    keyring: Keyring, make_server: Callable[..., ControlServer]
) -> None:
    server = make_server(
        keys=keyring.server.keys, authorized=load_authorized_keys(keyring.authorized_file)
    )
    with _pool(keyring, server_public_key=keyring.server.keys.public) as pool:
        client = pool.get(server.endpoint)
        assert pool.get(server.endpoint) is client
        assert server.endpoint in pool and len(pool) == 1
        client.send(p.Heartbeat(session_id="s"))
        inbound = server.recv(10_000)
        assert inbound is not None and inbound.user == keyring.client.keys.public_text
    assert len(pool) == 0


def test_closing_one_client_leaves_the_others(keyring: Keyring) -> None:
    with _pool(keyring, server_public_key=keyring.server.keys.public) as pool:
        a = pool.get("tcp://127.0.0.1:1")
        b = pool.get("tcp://127.0.0.1:2")
        assert pool.close("tcp://127.0.0.1:1") is True
        assert pool.close("tcp://127.0.0.1:1") is False
        assert list(pool) == [b]
        assert pool.get("tcp://127.0.0.1:1") is not a  # a quarantined peer starts afresh
        pool.close_all()
        assert len(pool) == 0


def test_a_new_producer_key_replaces_the_client(keyring: Keyring) -> None:
    with _pool(keyring) as pool:
        old = pool.get("tcp://127.0.0.1:1", keyring.server.keys.public)
        rotated = KeyPair.generate().public
        new = pool.get("tcp://127.0.0.1:1", rotated)
        assert new is not old and new.server_public_key == rotated
        assert pool.get("tcp://127.0.0.1:1") is new


def test_pool_needs_a_producer_key_unless_insecure(keyring: Keyring) -> None:
    with _pool(keyring) as pool, pytest.raises(ControlConfigError, match="public key"):
        pool.get("tcp://127.0.0.1:1")
