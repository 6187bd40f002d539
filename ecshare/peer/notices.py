"""One data plane's notifications, each handed to the part of the node it is for.

A node that is both producer and consumer (an engine that encodes and also
fetches) runs a Producer and a Consumer over one transport, and both loops
call its `progress()`. NIXL hands each notification out exactly once, to
whichever call takes it first. Left alone, the producer's loop would take a
push's notice ("push:<id>", for the consumer's Inbox) and count it as a bad
grant notice, and the consumer's loop would drop the producer's
"<session>:<grant>" notices. The push would still commit, on the producer's
`PushDone`, but one round trip later, and a fence that only the notice could
end would wait for the kept `PushDone` of a later session.

`Notices.of(transport)` is the one router of a transport, shared by every
part that runs over it: each part takes its own kind, and a notice of the
other kind is kept for that part when it runs here, or returned to the
caller (which counts it as unexpected) when nothing here takes that kind.
"""

from __future__ import annotations

import collections
import threading
import weakref
from typing import Final, Literal

from ecshare.transport.base import DataTransport

Kind = Literal["push", "grant"]
PUSH_NOTICE: Final = b"push:"
# Notices kept for a part that has not taken them yet; more means it stopped looking.
_KEPT: Final = 65536


def kind_of(note: bytes) -> Kind:
    """A push's write names its push ("push:<id>"); anything else is a grant's."""
    return "push" if note.startswith(PUSH_NOTICE) else "grant"


class Notices:
    """Notifications of one transport, sorted by the part they are for (any thread)."""

    _routers: weakref.WeakKeyDictionary[DataTransport, Notices] = weakref.WeakKeyDictionary()
    _routers_lock = threading.Lock()

    def __init__(self, transport: DataTransport) -> None:
        self._transport = transport
        self._lock = threading.Lock()
        self._takers: collections.Counter[Kind] = collections.Counter()
        self._kept: dict[Kind, collections.deque[tuple[str, bytes]]] = {
            "push": collections.deque(maxlen=_KEPT),
            "grant": collections.deque(maxlen=_KEPT),
        }

    @classmethod
    def of(cls, transport: DataTransport) -> Notices:
        """The router every part running over `transport` shares."""
        with cls._routers_lock:
            router = cls._routers.get(transport)
            if router is None:
                router = cls._routers[transport] = cls(transport)
            return router

    def join(self, kind: Kind) -> None:
        """A part that takes `kind` runs over this transport from now on."""
        with self._lock:
            self._takers[kind] += 1

    def leave(self, kind: Kind) -> None:
        with self._lock:
            self._takers[kind] -= 1
            if self._takers[kind] <= 0:
                del self._takers[kind]
                self._kept[kind].clear()

    def take(self, kind: Kind, *, progress: bool = True) -> list[tuple[str, bytes]]:
        """Progress the transport (unless `progress` is False); the notices of `kind`
        (kept ones first), and any of a kind nothing here takes."""
        with self._lock:
            mine = list(self._kept[kind])
            self._kept[kind].clear()
            for agent, note in self._transport.progress() if progress else ():
                other = kind_of(note)
                if other == kind or not self._takers[other]:
                    mine.append((agent, note))
                else:
                    self._kept[other].append((agent, note))
            return mine
