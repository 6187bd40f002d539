"""Registers the control-plane test fixtures, which live in control_testing.py."""

from control_testing import keyring, make_client, make_server, spawn_server

__all__ = ["keyring", "make_client", "make_server", "spawn_server"]
