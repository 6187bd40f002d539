"""Registers the operator-command tests' fixtures: the peer-layer ones, reused as they are."""

import sys
from pathlib import Path

# Real producer processes, consumers and raw sessions come from the peer tests' helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "peer"))

from peer_testing import children, keyring, make_consumer, raw_session, spawn_producer

__all__ = ["children", "keyring", "make_consumer", "raw_session", "spawn_producer"]
