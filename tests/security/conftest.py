"""Registers the security tests' fixtures: the peer-layer ones, plus a rival consumer key."""

import sys
from pathlib import Path

# The peer tests' helpers (real producer processes, consumers, raw sessions) are
# reused as they are, not copied.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peer"))

from peer_testing import (
    children,
    keyring,
    make_consumer,
    make_producer,
    raw_session,
    spawn_producer,
)
from security_testing import rival, rival_session

__all__ = [
    "children",
    "keyring",
    "make_consumer",
    "make_producer",
    "raw_session",
    "rival",
    "rival_session",
    "spawn_producer",
]
