"""One item's fetch, as an explicit state machine.

    QUEUED -> REQUESTED -> GRANTED -> READING -> DONE
       ^          |           |          |
       +----------+-----------+----------+   (retry or fail over to another peer)
    QUEUED -> DONE                           (a push of the item committed while it waited)
    any state -> FAILED(reason)

Every transition goes through `Transfer.move`, which refuses illegal ones and
counts legal ones, so a reader never has to infer state from which fields
happen to be set.
"""

from __future__ import annotations

import enum
import math
from concurrent.futures import Future
from typing import Final

import msgspec

from ecshare.errors import ECShareError, IllegalTransition
from ecshare.store import Entry, Hold


class TransferState(enum.Enum):
    QUEUED = "queued"  # waiting for a peer session, a batch, or a backoff
    REQUESTED = "requested"  # in a FetchRequest on the wire
    GRANTED = "granted"  # the producer pinned it; destination not yet read
    READING = "reading"  # the data-plane READ is in flight
    DONE = "done"
    FAILED = "failed"

    # Members are singletons compared by identity: hash them by it too, in C (Enum's
    # own __hash__ is Python code, and every `move` hashes states six times).
    __hash__ = object.__hash__


_LEGAL: Final[dict[TransferState, frozenset[TransferState]]] = {
    TransferState.QUEUED: frozenset(
        {TransferState.REQUESTED, TransferState.DONE, TransferState.FAILED}
    ),
    TransferState.REQUESTED: frozenset(
        {TransferState.GRANTED, TransferState.QUEUED, TransferState.FAILED}
    ),
    TransferState.GRANTED: frozenset(
        {TransferState.READING, TransferState.QUEUED, TransferState.FAILED}
    ),
    TransferState.READING: frozenset(
        {TransferState.DONE, TransferState.QUEUED, TransferState.FAILED}
    ),
    TransferState.DONE: frozenset(),
    TransferState.FAILED: frozenset(),
}


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


# The records of one fetch are msgspec Structs, built in C: a fetch makes each once,
# on a path that runs cold after an idle gap (a dataclass's generated __init__
# took 11 to 18 us there, against 3 to 6 us for the Struct).
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
    not_before: float = 0.0  # backoff: do not request before this time
    request_id: str = ""
    session_id: str = ""  # the session of its request: the one its grant is made on
    grant_id: str = ""
    nbytes: int = 0
    dtype: str = ""
    shape: tuple[int, ...] = ()
    checksum: int | None = None
    # Leases, on this side's clock: the producer's lease on the grant runs from
    # when it handled our request, so counting from when we sent it can only
    # end early. Commit only what finished by `lease_end`.
    requested_at: float = 0.0
    lease_s: float = 0.0  # as granted (or last renewed)
    lease_end: float = math.inf
    renew_at: float = math.inf  # when to ask for more, if still reading
    renew_sent: float = 0.0  # when the outstanding Renew went out (0: none)
    remote_extents: list[tuple[int, int]] = msgspec.field(default_factory=list)
    read_handle: object | None = None
    dest: Entry | None = None  # the local entry being written
    reasons: list[FailureReason] = msgspec.field(default_factory=list)  # per failed peer
    holds: list[Hold] = msgspec.field(default_factory=list)  # pins to take as it commits
    holds_taken: int = 0  # of `holds`, those a push's commit took
    # A push of the item is expected or reserved: not requested before `not_before`.
    awaiting_push: bool = False
    # The READ in flight is direct: no grant, no lease; kept only if the digest or
    # the tag checks out. `direct_tried`: one was tried from the current peer; ask it
    # instead.
    direct: bool = False
    direct_tried: bool = False
    # A direct read checked by tag: read the word at `tag_offset` back after the
    # bytes (`tag_read` once that READ is posted, into the landing's `tag_slot`,
    # a byte offset in our region; 0 once it is read or given up) and find `tag`.
    tag: int = 0
    tag_offset: int = 0
    tag_read: bool = False
    tag_slot: int = 0

    @property
    def peer(self) -> str | None:
        if self.peer_index < len(self.candidates):
            return self.candidates[self.peer_index]
        return None

    def move(self, new: TransferState) -> None:
        if new not in _LEGAL[self.state]:
            raise IllegalTransition(f"{self.mm_hash}: {self.state.value} -> {new.value}")
        self.state = new

    def clear_grant(self) -> None:
        self.direct = False
        self.tag = self.tag_offset = self.tag_slot = 0
        self.tag_read = False
        self.request_id = ""
        self.session_id = ""
        self.grant_id = ""
        self.remote_extents = []
        self.read_handle = None
        self.lease_end = self.renew_at = math.inf
        self.lease_s = self.renew_sent = 0.0

    def grant_lease(self, since: float, lease_s: float) -> None:
        """A lease of `lease_s` counted from `since` (when we asked); renew at half of it."""
        self.lease_s = lease_s
        self.lease_end = since + lease_s
        self.renew_at = since + lease_s / 2

    def give_up_at(self, margin_s: float) -> float:
        """When a read must be abandoned: the fetch's deadline, or `margin_s` before
        the lease ends."""
        return min(self.deadline, self.lease_end - margin_s)

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
