"""What the harness and its child processes say to each other over their pipes.

Each child (a producer or a consumer node) gets one spec at start, takes
commands and answers with events. All of them are msgspec Structs, pickled
over a `multiprocessing` pipe (`ecshare.apps.bench.child`, which also defines the
`Ready`, `Failed` and `Stop` every child shares).
"""

from __future__ import annotations

from typing import Any

import msgspec

from ecshare.apps.bench.child import Failed, Ready, Stop
from ecshare.store import StoreStats


class ProducerSpec(msgspec.Struct, frozen=True):
    config: dict[str, Any]
    fingerprint: str
    # Entries the producer "encodes", as SIZE:COUNT pairs: the working set. When it
    # is larger than the region, putting them evicts others (eviction pressure).
    working_set: str
    churn_per_s: float  # puts per second of a random working-set entry it lacks
    seed: int
    netns: str = ""  # the network namespace the child enters before anything else


class ConsumerSpec(msgspec.Struct, frozen=True):
    config: dict[str, Any]
    fingerprint: str
    netns: str = ""
    # The working set every producer holds: pushed entries nobody asked for yet are
    # READY here too, and the checks count and verify them.
    working_set: str = ""
    # Producers to hold sessions with from the start (a consumer that takes pushes:
    # the sessions are the push channel).
    peers: list[str] = msgspec.field(default_factory=list)


class Fetch(msgspec.Struct, frozen=True):
    """Fetch `items` ((fetch id, mm_hash, nbytes)) from `peers`, in preference order."""

    items: list[tuple[int, str, int]]
    peers: list[str]
    pushed: bool = False  # announced as pushed: the fetch waits for the push first


class Push(msgspec.Struct, frozen=True):
    """Push `items` ((push id, mm_hash)) to the consumer that takes pushes as `to`."""

    items: list[tuple[int, str]]
    to: str


class Fill(msgspec.Struct, frozen=True):
    """Fill the region with a half-written entry for `seconds`: nothing fits meanwhile."""

    seconds: float


class Quiesce(msgspec.Struct, frozen=True):
    """Stop creating new work (a producer stops its churn)."""


class Stats(msgspec.Struct, frozen=True):
    """Ask for a `NodeStats`; `verify` also checks every READY entry's bytes."""

    verify: bool = False


class Arm(msgspec.Struct, frozen=True):
    """Answer `ReadInFlight` once a read of at least `min_nbytes` is in flight here.

    A producer has one in flight while an entry that large is pinned by a grant; a
    consumer, while an entry that large is allocated as a read's destination. The
    child watches for up to `within_s` without holding up its other commands. With
    `freeze`, it SIGSTOPs itself right after answering, so the read stays in flight;
    the harness sends SIGCONT.
    """

    kind: str  # the fault that armed it, echoed back
    min_nbytes: int
    within_s: float
    freeze: bool
    # Watch for a push instead: a producer's push offered or being written, a
    # consumer's blocks reserved for one.
    push: bool = False
    # A consumer whose reads finish inside the read call (cross-memory attach) never
    # shows one in flight to another thread: watch for a large fetch in flight instead
    # (asked for, granted or being read, not yet settled).
    fetch: bool = False


Command = Fetch | Push | Fill | Quiesce | Stats | Stop | Arm


class Outcome(msgspec.Struct, frozen=True):
    """How one fetch ended, as the consumer process saw it."""

    fetch_id: int
    mm_hash: str
    # delivered (right bytes), corrupted (READY with wrong bytes or size),
    # vanished (delivered, then gone before it could be checked), failed (typed).
    status: str
    settle_s: float  # from the fetch() call to the future settling
    reason: str = ""
    detail: str = ""
    # time.monotonic() when it settled: CLOCK_MONOTONIC is one clock for every
    # process of the host, so the harness can tell which faults it settled under.
    settled_at: float = 0.0
    pushed: bool = False  # delivered: a producer wrote it here (FetchResult.pushed)


class PushEnded(msgspec.Struct, frozen=True):
    """How one push ended, as the producer saw it (`PushOutcome`)."""

    push_id: int
    state: str  # PushState's value
    detail: str
    settle_s: float  # from the push() call to its future settling


class NodeStats(msgspec.Struct, frozen=True):
    pid: int
    store: StoreStats
    counters: dict[str, int]
    invariant_error: str  # "" when the entry table's invariants hold
    used_by_ready: int  # blocks held by READY entries
    verified: int = 0  # READY entries whose bytes were checked (Stats(verify=True))
    wrong: list[str] = msgspec.field(default_factory=list)  # READY entries with wrong bytes
    active_grants: int = 0
    sessions: int = 0
    ready_keys: list[tuple[str, int]] = msgspec.field(default_factory=list)  # a few READY ones


class ReadInFlight(msgspec.Struct, frozen=True):
    """The answer to `Arm`; it comes whenever the child sees the read (or gives up)."""

    kind: str
    nbytes: int  # the read seen in flight; 0: none within the bound (and no freeze)
    frozen: bool  # the child stops itself right after sending this


Event = Ready | Outcome | PushEnded | NodeStats | Failed | ReadInFlight
