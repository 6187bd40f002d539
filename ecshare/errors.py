"""The base of every error ecshare raises on purpose, and the one illegal-transition error.

This module sits below every other layer and imports nothing of ecshare, so the
store, the transport and the peer layer can all derive their errors from it:
a caller that wants "anything ecshare refused" catches `ECShareError` alone.

`IllegalTransition` is shared by every state machine that raises it: the
store's entries (`ecshare.store.entries`), and the peer layer's transfers, push
reservations and pushes (through `ecshare.peer.machine`). Each means a bug in
the caller, never a peer's fault, so it is also a `RuntimeError`.
"""

from __future__ import annotations

__all__ = ["ECShareError", "IllegalTransition"]


class ECShareError(Exception):
    """Base of every error that ecshare raises on purpose."""


class IllegalTransition(ECShareError, RuntimeError):
    """An operation that the current state of an entry or a transfer does not allow."""
