"""The consumer's data-plane READs: posting, polling, and the one fence list.

`Reads` posts READs into this side's region, polls them, and holds back what a
READ given up may still write. It decides nothing about a fetch: a read that
has ended is reported to the caller as a return value (`ended`), and the
caller decides what follows.

Guarantees (invariant 2, ../../docs/ARCHITECTURE.md):
- A READ's destination is handed to nobody else while the read may still
  write it. A read given up for any reason is *fenced*: its blocks (or the
  landing slots a READ of tags writes) go back only when the transport says
  the READ has ended, which over TCP or RDMA can be long after we stopped
  caring. `fences` is the one list of them, each with its kind: a read given
  up, a warm-up read, a READ of tags. `poll_fences` is the only way their
  blocks and slots go back.
- The items granted in one reply are read with one READ (`SharedRead`): an
  item given up while it moves stays fenced until that whole READ has ended.
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from ecshare.peer.landing import TagLanding, TagRead
from ecshare.peer.transfer import Transfer
from ecshare.store import Entry, Store, StoreError
from ecshare.transport.base import DataTransport, ReadState, ReadStatus, Segment, pair_segments

log = logging.getLogger(__name__)

# While reads are moving, the loop polls them for this long before it looks at its
# sockets again, napping this long between polls (see `Reads.wait`).
READ_WAIT_S = 0.0005
READ_NAP_S = 0.00005
# The key of a session's warm-up read's destination (see `Reads.warm_up`); never READY.
WARM_UP_KEY = "ecshare-warm-up:"


class SharedRead:
    """One data-plane READ for the granted items of one reply. Each item's transfer
    holds it as its `read_handle`; the transport's handle is released when the last
    of them lets it go, so a destination given up early is fenced, as ever, until
    the backend has ended the whole READ. One READ instead of one per item saves
    the backend's per-transfer work and merges items that lie end to end."""

    __slots__ = ("ended", "handle", "landing", "users")

    def __init__(self, handle: object, users: int, landing: TagRead | None = None) -> None:
        self.handle = handle
        self.users = users
        # The transport's word that the READ has ended, kept: its users see it in one
        # pass, and asking the backend again for each of them costs it each time.
        self.ended: ReadStatus | None = None
        self.landing = landing  # a READ of tags: the slots it writes


class FenceKind(enum.Enum):
    GIVEN_UP = "given_up"  # a fetch's read: its destination entry is quarantined
    WARM_UP = "warm_up"  # a session's warm-up read: its one-block destination
    TAG_LANDING = "tag_landing"  # a READ of tags: the landing's slots it writes


@dataclass(frozen=True)
class Fence:
    """A READ that may still write what it holds (`dest` or `landing`)."""

    kind: FenceKind
    handle: object
    since: float
    dest: Entry | None = None
    landing: TagRead | None = None
    endpoint: str = ""  # a given-up read: its producer, session and grant
    session_id: str = ""
    grant_id: str = ""


class Reads:
    """The READs of one consumer, and the fences of those given up. Network thread
    only (or a caller lending its thread under the consumer's network lock)."""

    def __init__(
        self,
        store: Store,
        transport: DataTransport,
        landing: TagLanding | None,
        count: Callable[[str], None],
    ) -> None:
        self._store = store
        self._transport = transport
        self._landing = landing
        self._count = count
        self.fences: list[Fence] = []

    # -- posting and polling -------------------------------------------------------------

    def post(
        self,
        agent: str,
        reads: list[tuple[Transfer, list[Segment]]],
        landing: TagRead | None = None,
    ) -> object:
        """Post one READ of every segment of `reads` and give each transfer its share of
        the handle (see `SharedRead`); `landing`: the slots a READ of tags writes."""
        handle = self._transport.read(agent, [s for _, segs in reads for s in segs])
        if len(reads) == 1 and landing is None:
            shared = handle
        else:
            shared = SharedRead(handle, len(reads), landing)
        for t, _ in reads:
            t.read_handle = shared
        return shared

    def poll(self, handle: object) -> ReadStatus:
        if isinstance(handle, SharedRead):
            if handle.ended is not None:
                return handle.ended
            status = self._transport.poll(handle.handle)
            if status.state is not ReadState.PENDING:
                handle.ended = status
            return status
        return self._transport.poll(handle)

    def release(self, handle: object) -> None:
        """A transfer is done with its READ: the transport's handle goes (a PENDING one
        abandoned, as `DataTransport.release` says) once no transfer holds it, and
        so do the slots of a READ of tags, or they are fenced until it ends."""
        if isinstance(handle, SharedRead):
            handle.users -= 1
            if handle.users:
                return
            if handle.landing is not None:
                assert self._landing is not None
                if handle.ended is not None:
                    self._landing.give_back(handle.landing)
                else:  # given up while it may still write them
                    self.fences.append(
                        Fence(
                            FenceKind.TAG_LANDING,
                            handle.handle,
                            time.monotonic(),
                            landing=handle.landing,
                        )
                    )
                    self._count("tag_reads_fenced")
            handle = handle.handle
        self._transport.release(handle)

    def wait(self, handles: list[object]) -> None:
        """Poll reads still moving (TCP, RDMA) for up to `READ_WAIT_S`, napping between.

        Each poll also progresses our side of the data plane, which an asynchronous
        read needs as much as the target's, so waiting for the next pass of the whole
        loop would leave TCP reads stalled; the naps leave a core to the other side's
        progress on a small host. Returns when one read has ended, or when the time
        is up so that the sockets get their turn.
        """
        poll = self.poll
        until = time.monotonic() + READ_WAIT_S
        while True:
            for handle in handles:
                if poll(handle).state is not ReadState.PENDING:
                    return
            if time.monotonic() >= until:
                return
            time.sleep(READ_NAP_S)

    def ended(self, t: Transfer) -> tuple[ReadStatus, int] | None:
        """`t`'s READ, if it has ended: its status, and the tag its slot brought back
        (0 if none); the handle is let go. None while it moves."""
        status = self.poll(t.read_handle)
        if status.state is ReadState.PENDING:
            return None
        landed = 0  # read while the slot is held: the last user gives the slots back
        direct = t.direct
        if direct is not None and direct.tag_slot:
            assert self._landing is not None
            if status.state is ReadState.DONE:
                landed = self._landing.word(direct.tag_slot)
            direct.tag_slot = 0
        self.release(t.read_handle)
        t.read_handle = None
        return status, landed

    # -- giving up -----------------------------------------------------------------------

    def abandon(self, t: Transfer) -> None:
        """`t` gives its read up: its destination goes back now if nothing may write
        it any more, else it is fenced."""
        handle, dest = t.read_handle, t.dest
        t.read_handle = None
        t.dest = None
        direct = t.direct
        if direct is not None:
            direct.tag_slot = 0
        if dest is None:
            return
        if handle is None:
            self._store.abort(dest)
            return
        if direct is not None and direct.tag_read:
            # Only the READ of its tag moves, and it writes the landing, whose slots
            # wait for it (`release`); the bytes' READ has ended: the blocks go.
            self.release(handle)
            self._store.abort(dest)
            return
        granted = t.granted
        self._store.quarantine(dest)
        self.release(handle)  # abandoned: the transport keeps driving it
        self.fences.append(
            Fence(
                FenceKind.GIVEN_UP,
                handle,
                time.monotonic(),
                dest=dest,
                endpoint=t.peer or "",
                session_id=granted.session_id if granted is not None else "",
                grant_id=granted.grant_id if granted is not None else "",
            )
        )
        self._count("reads_fenced")

    def drop_dest(self, t: Transfer) -> None:
        """`t`'s READ has ended without bytes worth keeping: its destination goes."""
        if t.dest is not None:
            self._store.abort(t.dest)
            t.dest = None

    def warm_up(self, agent: str, session_id: str, endpoint: str) -> None:
        """Wire the data plane to a newly welcomed producer now, not in its first fetch.

        The first READ to a new peer waits for UCX's connection wire-up, which needs
        the target to progress, so a first fetch would pay it: one byte is read now
        from the producer's region into a block of ours and thrown away. No grant is
        needed: a READ changes nothing at the producer, the byte is never used, and
        the session already has the region's registration. The block is fenced until
        the transport says the read has ended.
        """
        try:
            dest = self._store.allocate(WARM_UP_KEY + session_id, 1)
        except StoreError:  # a full region, say: the first fetch wires it up instead
            self._count("warm_ups_skipped")
            return
        try:
            handle = self._transport.read(agent, pair_segments(dest.extents, [(0, 1)]))
        except Exception as exc:  # the first fetch meets it again, and says why
            log.debug("warm-up read from %s failed to start: %s", endpoint, exc)
            self._store.abort(dest)
            self._count("warm_ups_skipped")
            return
        self._store.quarantine(dest)
        self._transport.release(handle)  # abandoned: the transport drives it to its end
        self.fences.append(Fence(FenceKind.WARM_UP, handle, time.monotonic(), dest=dest))
        self._count("warm_ups")

    # -- the fences ----------------------------------------------------------------------

    def poll_fences(self) -> list[Fence]:
        """Give back what each fenced READ that has now ended held; returns the given-up
        reads among them (their grants may be released before their leases end)."""
        if not self.fences:
            return []
        keep: list[Fence] = []
        ended: list[Fence] = []
        for f in self.fences:
            if self.poll(f.handle).state is ReadState.PENDING:
                keep.append(f)
            elif f.kind is FenceKind.TAG_LANDING:
                assert self._landing is not None and f.landing is not None
                self._landing.give_back(f.landing)
            else:
                assert f.dest is not None
                self._store.release_quarantined(f.dest)
                if f.kind is FenceKind.GIVEN_UP:
                    self._count("fenced_reads_ended")
                    ended.append(f)
        self.fences = keep
        return ended

    def held(self, kind: FenceKind) -> tuple[int, float]:
        """Fenced READs of `kind` not yet ended, and the age of the oldest (0 if none)."""
        fences = [f for f in tuple(self.fences) if f.kind is kind]  # any thread may ask
        if not fences:
            return 0, 0.0
        return len(fences), time.monotonic() - min(f.since for f in fences)

    def by_kind(self) -> dict[str, int]:
        """Fenced READs not yet ended, per kind (every kind named)."""
        fences = tuple(self.fences)
        return {k.value: sum(f.kind is k for f in fences) for k in FenceKind}

    @property
    def warming(self) -> int:
        """Warm-up reads not yet ended."""
        return self.held(FenceKind.WARM_UP)[0]

    def endpoints(self) -> set[str]:
        """The producers whose given-up reads are still fenced."""
        return {f.endpoint for f in self.fences if f.kind is FenceKind.GIVEN_UP}
