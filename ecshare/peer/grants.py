"""The producer's grant book: which session holds which entry pinned, and until when.

A grant pins one READY entry under (session, grant id) for `grant_lease_s`. It
ends on the consumer's Release (or its data-plane completion notice), or when
its lease runs out, whichever comes first; the entry's blocks are never reused
while the pin holds. A session that ends without releasing (Bye, heartbeats
stopping) leaves its grants to run to their leases ("lingering"): a read may
still be moving over the data plane while the control plane is cut.

Grant ids carry this process's random epoch and are never reused, so a Release
can only end a grant of the process and session that made it; anything else is
counted (`releases_unmatched`) and changes nothing. A repeated FetchRequest (a
retry after a lost reply) is answered from the session's reply cache: the same
grants, leases renewed, nothing pinned twice, and never a grant that has ended.

The book does no I/O: the producer's loop hands it requests and notices and
sends what it returns. It is changed on that loop's thread only; `lock` guards
what other threads read (each session's grants and cached replies).
"""

from __future__ import annotations

import itertools
import secrets
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from ecshare import protocol as p
from ecshare.config import Config
from ecshare.store import EntryState, NotFound, NotReady, Store

# Cached replies per session, so that a duplicate FetchRequest returns the same
# grants instead of pinning again. Only replies that granted something are kept: a
# refusal pins nothing, so a repeat is answered afresh. A session's cache is
# bounded in replies and in items (at least one full batch), so that no peer makes
# the producer hold more than that for it.
_REPLY_CACHE_PER_SESSION = 256
_REPLY_CACHE_ITEMS_PER_SESSION = 1024

SESSION_OWNER_PREFIX = "session:"


def pin_owner(session_id: str) -> str:
    """The entry-table owner of a session's grants."""
    return SESSION_OWNER_PREFIX + session_id


@dataclass(eq=False)
class Session:
    """One consumer's session, as the producer keeps it."""

    session_id: str
    user: str  # the authenticated CURVE public key (Z85); "" when insecure
    route: bytes
    client_name: str
    agent_name: str
    version: int
    last_seen: float
    grants: dict[str, int] = field(default_factory=dict)  # grant id -> bytes it pins
    # Pins are held under this owner name in the entry table: session ids are
    # chosen by clients, so they get a namespace of their own that no other
    # owner (the engine's own load pins, say) can share.
    owner: str = ""

    def __post_init__(self) -> None:
        self.owner = pin_owner(self.session_id)

    pinned_bytes: int = 0  # the sum of `grants`, kept as they come and go
    push_name: str = ""  # the consumer accepts pushes under this name ("": none)
    replies: OrderedDict[str, p.FetchReply] = field(default_factory=OrderedDict)
    cached_items: int = 0  # items in `replies`
    direct: bool = False  # reads directly: told where each committed entry lies

    def cache(self, reply: p.FetchReply, max_items: int) -> None:
        """Keep `reply` for repeats of its request, dropping the oldest past the bounds."""
        self.replies[reply.request_id] = reply
        self.cached_items += len(reply.items)
        while len(self.replies) > _REPLY_CACHE_PER_SESSION or self.cached_items > max_items:
            _, old = self.replies.popitem(last=False)
            self.cached_items -= len(old.items)

    def forget(self, grant_id: str) -> bool:
        """Drop a grant from the books (the caller holds the book's lock)."""
        nbytes = self.grants.pop(grant_id, None)
        if nbytes is None:
            return False
        self.pinned_bytes -= nbytes
        return True


class Grants:
    """Grants, renewals, releases and lease ends of the producer's sessions."""

    def __init__(
        self,
        store: Store,
        config: Config,
        *,
        lock: threading.Lock,
        find: Callable[[str], Session | None],
        count: Callable[[str, int], None],
    ) -> None:
        """`find` names an open session by id; `lock` guards each session's grants and
        replies against readers on other threads; `count` adds to a named counter."""
        self._store = store
        self._config = config
        self._lock = lock
        self._find = find
        self._count = count
        self._ids = itertools.count(1)
        # Names this process in its grant ids: a restarted producer reuses no id.
        self._epoch = secrets.token_hex(8)
        # Grants of ended sessions, left to run to their leases (owner, grant id).
        # While any remain, reads may still be moving and need our progress.
        self.lingering: set[tuple[str, str]] = set()

    # -- requests ----------------------------------------------------------------------------

    def fetch(self, session: Session, msg: p.FetchRequest) -> p.Message:
        """The answer to a FetchRequest: its releases first, then a grant or a refusal
        per item, or the cached answer to the same request."""
        cfg = self._config
        self._count("fetch_requests", 1)
        if msg.releases:
            # First, so that the grants below see the session's limits without them.
            self._count("releases_in_requests", len(self.release(session, msg.releases)))
        cached = session.replies.get(msg.request_id)
        if cached is not None:
            # The same attempt again: same grants, leases renewed, nothing pinned twice.
            self._count("duplicate_requests", 1)
            replayed = [self._replayed(session, item) for item in cached.items]
            if replayed != cached.items:
                cached = p.FetchReply(request_id=msg.request_id, items=replayed)
                session.replies[msg.request_id] = cached
            return cached
        if len(msg.items) > cfg.max_batch_items:
            self._count("refused_batch", 1)
            return p.Error(
                code=p.ErrorCode.BATCH_TOO_LARGE,
                message=f"{len(msg.items)} items, limit {cfg.max_batch_items}",
                request_id=msg.request_id,
            )
        items = [self._grant_one(session, req) for req in msg.items]
        reply = p.FetchReply(request_id=msg.request_id, items=items)
        if any(item.status is p.ItemStatus.GRANTED for item in items):
            with self._lock:
                session.cache(reply, max(_REPLY_CACHE_ITEMS_PER_SESSION, cfg.max_batch_items))
        return reply

    def _grant_one(self, session: Session, req: p.ItemRequest) -> p.ItemReply:
        cfg = self._config
        entry = self._store.get(req.mm_hash)
        if entry is None or entry.state in (EntryState.EVICTING, EntryState.FREED):
            self._count("refused_missing", 1)
            return p.ItemReply(mm_hash=req.mm_hash, status=p.ItemStatus.MISSING)
        if entry.state is EntryState.ALLOCATED:
            self._count("refused_not_ready", 1)
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.NOT_READY,
                retry_after_ms=int(cfg.retry_initial_backoff_s * 1000),
            )
        if req.max_nbytes and entry.nbytes > req.max_nbytes:
            self._count("refused_too_large", 1)
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.TOO_LARGE,
                nbytes=entry.nbytes,
                detail=f"{entry.nbytes} bytes > {req.max_nbytes}",
            )
        if len(session.grants) >= cfg.max_grants_per_session:
            self._count("refused_overloaded", 1)
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.OVERLOADED,
                retry_after_ms=int(cfg.retry_max_backoff_s * 1000),
            )
        cap = cfg.max_pinned_bytes_per_session
        if cap is not None and session.pinned_bytes + entry.nbytes > cap:
            self._count("refused_pinned_bytes", 1)
            if entry.nbytes > cap:  # never grantable to anyone: not worth a retry
                return p.ItemReply(
                    mm_hash=req.mm_hash,
                    status=p.ItemStatus.TOO_LARGE,
                    nbytes=entry.nbytes,
                    detail=f"{entry.nbytes} bytes > max_pinned_bytes_per_session {cap}",
                )
            return p.ItemReply(
                mm_hash=req.mm_hash,
                status=p.ItemStatus.OVERLOADED,
                retry_after_ms=int(cfg.retry_max_backoff_s * 1000),
                detail=f"session holds {session.pinned_bytes} pinned bytes, limit {cap}",
            )
        grant_id = f"g{next(self._ids)}.{self._epoch}"
        try:
            self._store.pin(req.mm_hash, session.owner, grant_id, cfg.grant_lease_s)
        except NotReady:
            self._count("refused_not_ready", 1)
            return p.ItemReply(mm_hash=req.mm_hash, status=p.ItemStatus.NOT_READY)
        except NotFound:
            self._count("refused_missing", 1)
            return p.ItemReply(mm_hash=req.mm_hash, status=p.ItemStatus.MISSING)
        # Re-read under the pin: the entry cannot change or move from here on.
        pinned = self._store.pinned_entry(session.owner, grant_id)
        assert pinned is not None
        with self._lock:
            session.grants[grant_id] = pinned.nbytes
            session.pinned_bytes += pinned.nbytes
        self._count("granted", 1)
        self._count("granted_bytes", pinned.nbytes)
        return p.ItemReply(
            mm_hash=req.mm_hash,
            status=p.ItemStatus.GRANTED,
            grant_id=grant_id,
            extents=[p.Extent(o, n) for o, n in pinned.extents],
            nbytes=pinned.nbytes,
            dtype=pinned.meta.dtype,
            shape=list(pinned.meta.shape),
            checksum=pinned.meta.checksum,
            lease_ms=int(cfg.grant_lease_s * 1000),
        )

    def renew(self, session: Session, msg: p.Renew) -> p.Renewed:
        lease_s = self._config.grant_lease_s
        renewed = [g for g in msg.grant_ids if self._renew(session, g)]
        self._count("renewed", len(renewed))
        return p.Renewed(renewed=renewed, lease_ms=int(lease_s * 1000))

    def _renew(self, session: Session, grant_id: str) -> bool:
        """Extend one of the session's grants; False if it is not (or no longer) live."""
        if grant_id not in session.grants:
            return False
        if self._store.renew(session.owner, grant_id, self._config.grant_lease_s):
            return True
        # The lease ran out before the reaper saw it, and the table has just let the
        # pin go: forget the grant too, or it would count against the session's
        # limits (and keep the loop polling) until the session ends.
        with self._lock:
            session.forget(grant_id)
        self._count("leases_expired", 1)
        return False

    def _replayed(self, session: Session, item: p.ItemReply) -> p.ItemReply:
        """A cached answer, again: never a grant whose pin has ended."""
        if not item.grant_id or self._renew(session, item.grant_id):
            return item
        # Released or expired: its blocks may hold another entry by now, so the
        # extents must not go out again, and pinning anew would pin twice for
        # one request.
        self._count("replayed_ended_grants", 1)
        return p.ItemReply(
            mm_hash=item.mm_hash,
            status=p.ItemStatus.MISSING,
            detail=f"grant {item.grant_id} of this request has ended; send a new request",
        )

    def release(self, session: Session, grant_ids: list[str]) -> list[str]:
        """End the session's grants named; the ids of those it held."""
        released = []
        unmatched = 0
        for grant_id in grant_ids:
            with self._lock:
                if not session.forget(grant_id):
                    # Another session's or process's grant, or released already.
                    unmatched += 1
                    continue
            if self._store.unpin(session.owner, grant_id):
                released.append(grant_id)
        self._count("released", len(released))
        if unmatched:
            self._count("releases_unmatched", unmatched)
        return released

    def on_notification(self, agent: str, note: bytes) -> None:
        """A data-plane completion notice "<session>:<grant>" releases that grant, but
        only from the agent that session announced, so forged notices do nothing."""
        try:
            session_id, grant_id = note.decode("ascii").split(":", 1)
        except (UnicodeDecodeError, ValueError):
            self._count("bad_notifications", 1)
            return
        session = self._find(session_id)
        if session is None or not session.agent_name or session.agent_name != agent:
            self._count("bad_notifications", 1)
            return
        self.release(session, [grant_id])

    # -- ends --------------------------------------------------------------------------------

    def reap(self) -> None:
        """Forget every grant whose lease has run out."""
        # Every expired pin of the table, not only our sessions': an engine sharing
        # this store (vLLM's connector) leaves its own lost pins to this reaper.
        for owner, grant_id in self._store.reap_expired():
            if not owner.startswith(SESSION_OWNER_PREFIX):
                continue
            session = self._find(owner.removeprefix(SESSION_OWNER_PREFIX))
            if session is not None:
                with self._lock:
                    session.forget(grant_id)
            self.lingering.discard((owner, grant_id))
            self._count("leases_expired", 1)
        # Anyone may end a pin whose lease ran out (the table does, on sight).
        self.lingering = {k for k in self.lingering if self._store.pinned_entry(*k)}

    def end(self, session: Session, *, keep_leases: bool) -> list[str]:
        """The session has ended: its grants run to their leases (`keep_leases`) or end
        now. Returns their ids; the caller takes the session out under the lock."""
        grants = list(session.grants)
        if keep_leases:
            self.lingering.update((session.owner, g) for g in grants)
            self._count("grants_left_to_lease", len(grants))
        else:
            self._store.unpin_owner(session.owner)
        return grants

    def end_lingering(self) -> None:
        """End every grant left to its lease (the producer is stopping)."""
        for owner, grant_id in list(self.lingering):
            self._store.unpin(owner, grant_id)
        self.lingering.clear()
