"""Registers the peer-layer test fixtures, which live in peer_testing.py (real NIXL and
processes) and loopback_testing.py (in-process nodes on LoopbackTransport)."""

from loopback_testing import fabric, loop_consumer, loop_producer
from peer_testing import (
    children,
    fake_producer,
    gate,
    keyring,
    make_consumer,
    make_producer,
    raw_session,
    spawn_producer,
)

__all__ = [
    "children",
    "fabric",
    "fake_producer",
    "gate",
    "keyring",
    "loop_consumer",
    "loop_producer",
    "make_consumer",
    "make_producer",
    "raw_session",
    "spawn_producer",
]
