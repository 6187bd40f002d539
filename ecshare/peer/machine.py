"""The one way a state machine of the peer layer says which moves are legal.

A transfer (`ecshare.peer.transfer`), a push reservation (`ecshare.peer.inbox`)
and a push (`ecshare.peer.pusher`) each keep their legal moves in one
`Transitions` table, right below their states, and check every move against it.
An illegal move raises `IllegalTransition`: a bug in the caller, never a peer's
fault.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from typing import Generic, TypeVar

from ecshare.errors import IllegalTransition

S = TypeVar("S", bound=enum.Enum)

__all__ = ["IllegalTransition", "Transitions"]


class Transitions(Generic[S]):
    """The legal moves out of each state; a state missing from the table is final."""

    __slots__ = ("_moves",)

    def __init__(self, moves: Mapping[S, Iterable[S]]) -> None:
        self._moves: dict[S, frozenset[S]] = {old: frozenset(new) for old, new in moves.items()}

    def allows(self, old: S, new: S) -> bool:
        moves = self._moves.get(old)
        return moves is not None and new in moves

    def check(self, what: str, old: S, new: S) -> None:
        """Raise `IllegalTransition` unless `old -> new` is a legal move of `what`."""
        moves = self._moves.get(old)
        if moves is None or new not in moves:
            raise IllegalTransition(f"{what}: {old.value} -> {new.value}")
