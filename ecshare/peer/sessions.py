"""The producer's session table: who may open a session, and what each holds.

A Hello opens a session only for a key on the consumer allow-list (an admin key
may ask for status, never fetch), in a protocol version both sides speak, with
the producer's compatibility fingerprint, and within `max_sessions` and
`max_sessions_per_key`; each refusal is a typed `Error` and a count. A session
belongs to the key that opened it: the same id from another key is refused, and
a Hello again from its own key only refreshes its route.

The table is changed on the producer's network thread only; `lock` guards it,
and each session's grants (`ecshare.peer.grants`), against readers on other
threads, who get copies.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.peer.grants import Session
from ecshare.peer.status import SessionView
from ecshare.store import Store


class Sessions:
    """The open sessions of one producer, by id."""

    def __init__(
        self,
        config: Config,
        *,
        fingerprint: str,
        authorized: frozenset[bytes],
        secure: bool,
        count: Callable[[str, int], None],
    ) -> None:
        self._config = config
        self._fingerprint = fingerprint
        self._authorized = authorized
        self._secure = secure  # insecure mode authenticates nobody, so no key is checked
        self._count = count
        self.lock = threading.Lock()
        self._by_id: dict[str, Session] = {}

    def find(self, session_id: str) -> Session | None:
        return self._by_id.get(session_id)

    def all(self) -> list[Session]:
        """The open sessions, as a list the caller may end them from."""
        return list(self._by_id.values())

    def open(self, route: bytes, user: str, msg: p.Hello) -> Session | p.Error:
        """The session `msg` opens (or opened before, for this key), or why not."""
        cfg = self._config
        if self._secure and user.encode("ascii") not in self._authorized:
            # Admitted by CURVE as an admin only: it may ask for status, not fetch.
            self._count("refused_not_authorized", 1)
            return p.Error(
                code=p.ErrorCode.FORBIDDEN,
                message="this key is an admin key, not an authorized consumer key",
            )
        version = p.negotiate_version(msg.versions)
        if version is None:
            self._count("refused_version", 1)
            return p.Error(
                code=p.ErrorCode.VERSION_MISMATCH,
                message=f"no common protocol version: peer speaks {msg.versions}, "
                f"this producer speaks {list(p.SUPPORTED_VERSIONS)}",
            )
        if msg.fingerprint != self._fingerprint:
            self._count("refused_fingerprint", 1)
            return p.Error(
                code=p.ErrorCode.FINGERPRINT_MISMATCH,
                message=f"compatibility fingerprint differs (producer {self._fingerprint}, "
                f"consumer {msg.fingerprint}): different model, revision, encoder config "
                "or dtype",
            )
        existing = self._by_id.get(msg.session_id)
        if existing is not None:
            if existing.user != user:
                self._count("no_session", 1)
                return p.Error(code=p.ErrorCode.NO_SESSION, message="session id in use")
            existing.route = route
            existing.last_seen = time.monotonic()
            return existing
        if len(self._by_id) >= cfg.max_sessions:
            self._count("refused_sessions", 1)
            return p.Error(
                code=p.ErrorCode.TOO_MANY_SESSIONS,
                message=f"producer holds its maximum of {cfg.max_sessions} sessions",
            )
        per_key = cfg.max_sessions_per_key
        if (
            per_key is not None
            and sum(1 for s in self._by_id.values() if s.user == user) >= per_key
        ):
            self._count("refused_sessions_per_key", 1)
            return p.Error(
                code=p.ErrorCode.TOO_MANY_SESSIONS,
                message=f"this key holds its maximum of {per_key} sessions here",
            )
        session = Session(
            session_id=msg.session_id,
            user=user,
            route=route,
            client_name=msg.client_name,
            agent_name=msg.data_plane.agent_name if msg.data_plane else "",
            version=version,
            last_seen=time.monotonic(),
        )
        with self.lock:
            self._by_id[msg.session_id] = session
        self._count("sessions_opened", 1)
        return session

    def remove(self, session: Session) -> None:
        """Take an ended session out; its grants are the book's to end first."""
        with self.lock:
            self._by_id.pop(session.session_id, None)
            session.grants.clear()
            session.pinned_bytes = 0

    def direct(self) -> list[Session]:
        """The sessions that read directly (told where each committed entry lies)."""
        return [s for s in self._by_id.values() if s.direct]

    def silent(self, now: float, longer_than: float) -> list[Session]:
        """The sessions not heard from for more than `longer_than` seconds at `now`."""
        return [s for s in self._by_id.values() if now - s.last_seen > longer_than]

    # -- for any thread ----------------------------------------------------------------------

    def count(self) -> int:
        with self.lock:
            return len(self._by_id)

    def active_grants(self) -> int:
        with self.lock:
            return sum(len(s.grants) for s in self._by_id.values())

    def grants_by_session(self) -> dict[str, list[str]]:
        """Each open session's outstanding grant ids, sorted: a copy."""
        with self.lock:
            return {sid: sorted(s.grants) for sid, s in self._by_id.items()}

    def cached_replies(self) -> dict[str, tuple[int, int]]:
        """Each open session's cached replies and the items in them: a copy."""
        with self.lock:
            return {sid: (len(s.replies), s.cached_items) for sid, s in self._by_id.items()}

    def views(self, store: Store) -> list[SessionView]:
        """What a status reply shows of each session (on the network thread)."""
        now = time.monotonic()
        views = []
        for s in self._by_id.values():
            pinned = (store.pinned_entry(s.owner, g) for g in s.grants)
            views.append(
                SessionView(
                    user=s.user,
                    client_name=s.client_name,
                    version=s.version,
                    grants=len(s.grants),
                    pinned_bytes=sum(e.nbytes for e in pinned if e is not None),
                    idle_s=now - s.last_seen,
                )
            )
        return views
