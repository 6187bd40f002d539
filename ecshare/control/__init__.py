"""The control plane: authenticated ZMQ messaging between producers and consumers.

It knows the wire messages and the peers' keys, and nothing about entries or
the data plane. A producer serves a `ControlServer`; a consumer keeps one
`ControlClient` per producer in a `ClientPool`; both are driven from one
network thread that a `Waker` can rouse from engine threads. A session's fetch
traffic may take a `LaneServer`/`LaneClient` fast lane beside ZMQ (lane.py).

May import: ecshare.errors, ecshare.counts, ecshare.config, ecshare.protocol, ecshare.store,
ecshare.transport.
"""

from ecshare.control.auth import AllowList
from ecshare.control.client import ControlClient
from ecshare.control.errors import AuthenticationFailed, ControlConfigError, ControlError
from ecshare.control.handshake import LinkState
from ecshare.control.keys import (
    KeyFiles,
    KeyPair,
    generate_keypair,
    load_authorized_keys,
    load_keypair,
    load_public_key,
)
from ecshare.control.lane import LaneClient, LaneServer, lane_host
from ecshare.control.link import CONSUMER_TO_PRODUCER, PRODUCER_TO_CONSUMER, Drop, LinkSettings
from ecshare.control.pool import ClientPool
from ecshare.control.server import ControlServer, Inbound
from ecshare.control.waker import Waker

__all__ = [
    "CONSUMER_TO_PRODUCER",
    "PRODUCER_TO_CONSUMER",
    "AllowList",
    "AuthenticationFailed",
    "ClientPool",
    "ControlClient",
    "ControlConfigError",
    "ControlError",
    "ControlServer",
    "Drop",
    "Inbound",
    "KeyFiles",
    "KeyPair",
    "LaneClient",
    "LaneServer",
    "LinkSettings",
    "LinkState",
    "Waker",
    "generate_keypair",
    "lane_host",
    "load_authorized_keys",
    "load_keypair",
    "load_public_key",
]
