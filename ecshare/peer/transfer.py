"""One item's fetch, as an explicit state machine, and what kind of read it is.

    QUEUED -> REQUESTED -> GRANTED -> READING -> DONE     (a granted read)
    QUEUED -> READING -> DONE                            (a direct read: no request, no grant)
    QUEUED -> DONE                                       (a pushed wait: the push committed)
    REQUESTED, GRANTED, READING -> QUEUED                (retry, or fail over to another peer)
    any state but DONE -> FAILED(reason)

A transfer says what its current attempt is: `read` holds a `GrantedRead` (the
request, its grant and lease) or a `DirectRead` (where the entry was said to
lie, and how its bytes are checked), or None while it is queued; a queued
transfer with `awaiting_push` set waits for a producer's push. Every transition
goes through `Transfer.move`, which refuses illegal ones (a direct read is the
only way from QUEUED to READING), so a reader never has to infer state from
which fields happen to be set.
"""

from __future__ import annotations

import enum
import math
from concurrent.futures import Future
from typing import Final

import msgspec

from ecshare.errors import ECShareError, IllegalTransition
from ecshare.peer.machine import Transitions
from ecshare.store import Entry, Hold


class TransferState(enum.Enum):
    QUEUED = "queued"  # waiting for a peer session, a batch, a backoff or a push
    REQUESTED = "requested"  # in a FetchRequest on the wire
    GRANTED = "granted"  # the producer pinned it; destination not yet read
    READING = "reading"  # the data-plane READ is in flight
    DONE = "done"
    FAILED = "failed"

    # Members are singletons compared by identity: hash them by it too, in C (Enum's
    # own __hash__ is Python code, and every `move` hashes states).
    __hash__ = object.__hash__


_MOVES: Final = Transitions(
    {
        TransferState.QUEUED: (
            TransferState.REQUESTED,
            TransferState.READING,
            TransferState.DONE,
            TransferState.FAILED,
        ),
        TransferState.REQUESTED: (
            TransferState.GRANTED,
            TransferState.QUEUED,
            TransferState.FAILED,
        ),
        TransferState.GRANTED: (TransferState.READING, TransferState.QUEUED, TransferState.FAILED),
        TransferState.READING: (TransferState.DONE, TransferState.QUEUED, TransferState.FAILED),
    }
)


def lease_margin(lease_s: float) -> float:
    """How long before a lease ends a read still moving is given up: covers the network
    thread's reaction time (a long synchronous read, a stall), not the clocks, which
    are never compared."""
    return min(1.0, 0.1 * lease_s)


class FailureReason(enum.Enum):
    """Why a fetch ended without data; every one means "encode it locally"."""

    MISSING = "missing"  # no peer holds the item
    INCOMPATIBLE = "incompatible"  # peers hold it for another model/config
    TOO_LARGE = "too_large"  # larger than the caller accepts
    PEER_UNREACHABLE = "peer_unreachable"  # no live, authenticated peer to ask
    AUTH_FAILED = "auth_failed"  # a peer refused our key, or we its key
    DEADLINE = "deadline"  # the item's deadline passed
    CHECKSUM_MISMATCH = "checksum_mismatch"  # every copy read was corrupt
    CHECKSUM_MISSING = "checksum_missing"  # a checksum is required and the item has none
    LOCAL_STORE_FULL = "local_store_full"  # no room here, even after eviction
    TRANSPORT = "transport"  # the data plane failed on every peer tried
    RETRIES_EXHAUSTED = "retries_exhausted"  # peers stayed busy or not ready
    SHUTDOWN = "shutdown"  # the consumer is stopping
    INTERNAL = "internal"  # the consumer's network thread died (a bug; see its log)


class FetchFailed(ECShareError):
    """The final, typed outcome of a fetch that delivered no data."""

    def __init__(self, mm_hash: str, reason: FailureReason, detail: str = "") -> None:
        super().__init__(
            f"fetch of {mm_hash} failed: {reason.value}" + (f": {detail}" if detail else "")
        )
        self.mm_hash = mm_hash
        self.reason = reason
        self.detail = detail


# The records of one fetch are msgspec Structs, built in C: a fetch makes each once, on
# a path that runs cold after an idle gap, where a dataclass's __init__ costs far more.
class FetchResult(msgspec.Struct, frozen=True):
    mm_hash: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    peer: str  # the endpoint the bytes came from, or "local"
    latency_s: float
    attempts: int
    pushed: bool = False  # the producer wrote it here (a push), rather than we read it


# Upper bounds of the fetch latency histogram's buckets (seconds): from a small
# item on one host (0.1 ms) to the longest deadline worth waiting for (10 s).
LATENCY_BUCKETS_S: Final = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)


class GrantedRead(msgspec.Struct, eq=False):
    """A read asked for and granted. Its lease is on this side's clock: the producer's
    lease on the grant runs from when it handled our request, so counting from when
    we sent it can only end early. Commit only what finished by `lease_end`."""

    request_id: str
    session_id: str  # the session of its request: the one its grant is made on
    requested_at: float
    grant_id: str = ""
    lease_s: float = 0.0  # as granted (or last renewed)
    lease_end: float = math.inf
    renew_at: float = math.inf  # when to ask for more, if still reading
    renew_sent: float = 0.0  # when the outstanding Renew went out (0: none)

    def grant_lease(self, since: float, lease_s: float) -> None:
        """A lease of `lease_s` counted from `since` (when we asked); renew at half of it."""
        self.lease_s = lease_s
        self.lease_end = since + lease_s
        self.renew_at = since + lease_s / 2


class DirectRead(msgspec.Struct, eq=False):
    """A read of an entry where its producer said it lies: no request, no grant, no
    lease; its bytes are kept only if its digest, or its tag, checks out. Checked by
    tag (`tag` set): the word at `tag_offset` is read back after the bytes
    (`tag_read` once that is posted, into the landing's `tag_slot`, a byte offset in
    our region; 0 once it is read or given up) and must be `tag`."""

    tag: int = 0
    tag_offset: int = 0
    tag_read: bool = False
    tag_slot: int = 0


class Transfer(msgspec.Struct, eq=False):
    mm_hash: str
    future: Future[FetchResult]
    candidates: list[str]  # peer endpoints, in preference order
    started: float
    deadline: float
    max_nbytes: int = 0
    state: TransferState = TransferState.QUEUED
    peer_index: int = 0
    attempts: int = 0  # requests sent, over all peers
    retries_here: int = 0  # retryable refusals from the current peer
    not_before: float = 0.0  # backoff (or a push's wait): do not request before this time
    # The current attempt at the current peer (None while queued).
    read: GrantedRead | DirectRead | None = None
    # A pushed wait: a push of the item is expected or reserved; not requested before
    # `not_before`.
    awaiting_push: bool = False
    direct_tried: bool = False  # a direct read was tried at the current peer: ask it
    # What the grant or the location said of the entry.
    nbytes: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    checksum: int | None = None
    remote_extents: list[tuple[int, int]] = msgspec.field(default_factory=list)
    read_handle: object | None = None
    dest: Entry | None = None  # the local entry being written
    reasons: list[FailureReason] = msgspec.field(default_factory=list)  # per failed peer
    holds: list[Hold] = msgspec.field(default_factory=list)  # pins to take as it commits
    holds_taken: int = 0  # of `holds`, those a push's commit took

    @property
    def peer(self) -> str | None:
        if self.peer_index < len(self.candidates):
            return self.candidates[self.peer_index]
        return None

    @property
    def granted(self) -> GrantedRead | None:
        read = self.read
        return read if type(read) is GrantedRead else None

    @property
    def direct(self) -> DirectRead | None:
        read = self.read
        return read if type(read) is DirectRead else None

    def move(self, new: TransferState) -> None:
        old = self.state
        _MOVES.check(self.mm_hash, old, new)
        if (
            old is TransferState.QUEUED
            and new is TransferState.READING
            and type(self.read) is not DirectRead
        ):
            raise IllegalTransition(f"{self.mm_hash}: queued -> reading without a direct read")
        self.state = new

    def clear_grant(self) -> None:
        """The attempt at the current peer is over: nothing of it is kept."""
        self.read = None
        self.remote_extents = []
        self.read_handle = None

    def give_up_at(self) -> float:
        """When a read must be abandoned: the fetch's deadline, or (a granted read)
        `lease_margin` before its lease ends."""
        read = self.read
        if type(read) is GrantedRead:
            return min(self.deadline, read.lease_end - lease_margin(read.lease_s))
        return self.deadline

    def next_peer(self, reason: FailureReason) -> bool:
        """Give up on the current peer; True when another candidate remains."""
        self.reasons.append(reason)
        self.peer_index += 1
        self.retries_here = 0
        self.direct_tried = False
        self.not_before = 0.0
        return self.peer is not None

    def final_reason(self) -> FailureReason:
        """The most telling reason among the peers tried."""
        for preferred in (
            FailureReason.CHECKSUM_MISMATCH,
            FailureReason.CHECKSUM_MISSING,
            FailureReason.INCOMPATIBLE,
            FailureReason.TOO_LARGE,
            FailureReason.AUTH_FAILED,
            FailureReason.TRANSPORT,
            FailureReason.RETRIES_EXHAUSTED,
            FailureReason.DEADLINE,
            FailureReason.PEER_UNREACHABLE,
            FailureReason.LOCAL_STORE_FULL,
        ):
            if preferred in self.reasons:
                return preferred
        return FailureReason.MISSING if self.reasons else FailureReason.PEER_UNREACHABLE
