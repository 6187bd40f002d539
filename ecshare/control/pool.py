"""One control client per producer endpoint, created on first use.

A consumer talks to many producers, learning each endpoint from a request's
transfer params. The pool keeps one connection (and so one CURVE handshake)
per producer, and lets the consumer close one it has given up on (a
quarantined peer) so that the next use starts afresh.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import zmq

from ecshare.control.client import ControlClient
from ecshare.control.keys import KeyPair, require_z85_key
from ecshare.control.link import LinkSettings

log = logging.getLogger(__name__)


class ClientPool:
    """`ControlClient`s keyed by endpoint, sharing keys, settings and a zmq context.

    Use from the thread that uses the clients.
    """

    def __init__(
        self,
        *,
        keys: KeyPair | None,
        server_public_key: bytes | None = None,
        insecure: bool = False,
        settings: LinkSettings = LinkSettings(),
        reconnect_ivl_s: float = 0.1,
        reconnect_ivl_max_s: float = 5.0,
        context: zmq.Context[Any] | None = None,
    ) -> None:
        self.keys = keys
        # The default producer key, for clusters whose producers share one key pair.
        self.server_public_key = server_public_key
        self.insecure = insecure
        self.settings = settings
        self.reconnect_ivl_s = reconnect_ivl_s
        self.reconnect_ivl_max_s = reconnect_ivl_max_s
        self.context = context
        self._clients: dict[str, ControlClient] = {}

    def get(self, endpoint: str, server_public_key: bytes | None = None) -> ControlClient:
        """The client for `endpoint`, connecting it on first use.

        A `server_public_key` different from the one the existing client uses
        replaces that client: the producer's key changed.
        """
        key = server_public_key if server_public_key is not None else self.server_public_key
        if key is not None:
            key = require_z85_key(key, where=f"public key of producer {endpoint}")
        client = self._clients.get(endpoint)
        if client is not None:
            if server_public_key is None or client.server_public_key == key:
                return client
            log.info("producer %s has a new public key; reconnecting", endpoint)
            self.close(endpoint)
        client = ControlClient(
            endpoint,
            server_public_key=None if self.insecure else key,
            keys=self.keys,
            insecure=self.insecure,
            settings=self.settings,
            reconnect_ivl_s=self.reconnect_ivl_s,
            reconnect_ivl_max_s=self.reconnect_ivl_max_s,
            context=self.context,
        )
        self._clients[endpoint] = client
        return client

    def close(self, endpoint: str) -> bool:
        """Close and forget the client for `endpoint`; False if there was none."""
        client = self._clients.pop(endpoint, None)
        if client is None:
            return False
        client.close()
        return True

    def close_all(self) -> None:
        while self._clients:
            _, client = self._clients.popitem()
            client.close()

    def __contains__(self, endpoint: object) -> bool:
        return endpoint in self._clients

    def __len__(self) -> int:
        return len(self._clients)

    def __iter__(self) -> Iterator[ControlClient]:
        return iter(list(self._clients.values()))

    def __enter__(self) -> ClientPool:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close_all()
