"""Registers the peer-layer test fixtures, which live in peer_testing.py."""

from peer_testing import (
    children,
    keyring,
    make_consumer,
    make_producer,
    raw_session,
    spawn_producer,
)

__all__ = [
    "children",
    "keyring",
    "make_consumer",
    "make_producer",
    "raw_session",
    "spawn_producer",
]
