"""Registers the metrics tests' fixtures: the peer-layer ones (real producer processes,
consumers over NIXL and CURVE on 127.0.0.1, and in-process ones on LoopbackTransport)."""

import sys
from pathlib import Path

# The peer tests' helpers are reused as they are, not copied.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peer"))

from loopback_testing import fabric, loop_consumer, loop_producer
from peer_testing import children, keyring, make_consumer, make_producer, spawn_producer

__all__ = [
    "children",
    "fabric",
    "keyring",
    "loop_consumer",
    "loop_producer",
    "make_consumer",
    "make_producer",
    "spawn_producer",
]
