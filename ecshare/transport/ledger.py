r"""The books every transport keeps, whatever moves its bytes.

`Ledger` is the half of a transport that is the same over NIXL (nixl.py) and
in process (loopback.py): the checks of what a caller hands in, each
transfer's life from its start to its end, the counters, and the peers with
their retirement. A transport subclasses it and adds only its backend: what
the region and a peer's metadata are to it (`_register`, `_metadata`, `_load`,
`_unload`), how a transfer is posted and driven (`_launch`, `poll`,
`progress`), and what it frees once a transfer has ended (`_let_go`).

A transfer's life, each end on the backend's word only:

    started -> PENDING -> DONE           (reads_done, bytes_read)
                      \-> FAILED(kind)   (reads_failed[kind])
    PENDING -release-> abandoned -> DONE or FAILED   (reads_cancelled)

A transfer refused before it is posted (unknown peer, segments outside a
region) is FAILED from the start. Every transfer ends exactly once, in `_done`
or `_finish`, so once `in_flight` is 0
``reads_started == reads_done + sum(reads_failed.values()) + reads_cancelled``,
and the same under `writes_*` (with `bytes_written`). A transfer released
while PENDING counts in `reads_abandoned` at once and in `reads_cancelled`
when it has ended; until then its destination may still be written.

Peers. A peer is kept under its agent name with its transfers in flight.
`remove_peer` of a peer with transfers in flight retires it: new transfers to
it fail NOT_FOUND at once, the old ones run to their end, and the peer is
unloaded after the last. Re-adding the same `PeerInfo` takes it back; other
metadata under its name is refused until its transfers have ended.

The methods whose names start with an underscore run under the transport's lock.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, ClassVar, Generic, TypeVar, cast

from ecshare.transport.base import (
    FailureKind,
    PeerInfo,
    ReadHandle,
    ReadState,
    ReadStatus,
    Segment,
    TransportError,
)

__all__ = ["Handle", "Ledger", "Peer", "out_of_bounds"]

PENDING = ReadStatus(ReadState.PENDING)
DONE = ReadStatus(ReadState.DONE)


def out_of_bounds(segments: Sequence[Segment], local_size: int, remote_size: int) -> str:
    """Why the segments are not all inside both regions, or "" if they are."""
    if not segments:
        return "no segments"
    for s in segments:
        if s.length <= 0 or s.local_offset < 0 or s.remote_offset < 0:
            return f"bad segment {s}"
        if s.local_offset + s.length > local_size:
            return f"{s} outside the local region ({local_size} bytes)"
        if s.remote_offset + s.length > remote_size:
            return f"{s} outside the peer's region ({remote_size} bytes)"
    return ""


class Handle:
    """One transfer (a read, or a write); opaque to callers, who pass it back to
    `poll` and `release`."""

    __slots__ = ("abandoned", "nbytes", "op", "peer", "status")

    def __init__(self, peer: str, nbytes: int, op: str) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.op = op  # "READ" or "WRITE"
        self.status = PENDING
        self.abandoned = False  # released while PENDING: its end counts as cancelled

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.op}, peer={self.peer!r}, nbytes={self.nbytes}, "
            f"{self.status.state.value})"
        )


H = TypeVar("H", bound=Handle)


class Peer(Generic[H]):
    """A loaded peer: what it published, and our transfers with it not yet ended."""

    __slots__ = ("info", "reads")

    def __init__(self, info: PeerInfo) -> None:
        self.info = info
        self.reads: set[H] = set()


P = TypeVar("P", bound="Peer[Any]")
L = TypeVar("L", bound="Ledger[Any, Any]")


class Ledger(abc.ABC, Generic[H, P]):
    """The shared half of a `DataTransport`; see the module docstring."""

    _kind: ClassVar[str]  # PeerInfo.kind of this data plane
    _handle_type: ClassVar[type[Handle]]

    def __init__(self, name: str, lock: AbstractContextManager[Any]) -> None:
        if not name:
            raise ValueError("agent name must not be empty")
        self._name = name
        self._lock = lock
        self._region: tuple[int, int] | None = None
        self._peers: dict[str, P] = {}
        # Removed peers whose transfers have not ended yet, kept loaded until they have.
        self._retired: dict[str, P] = {}
        self._abandoned: set[H] = set()  # released while PENDING, still running
        self._closed = False

        self.reads_started = 0
        self.reads_done = 0
        self.reads_failed: dict[FailureKind, int] = dict.fromkeys(FailureKind, 0)
        self.reads_cancelled = 0
        self.reads_abandoned = 0
        self.bytes_read = 0
        self.writes_started = 0
        self.writes_done = 0
        self.writes_failed: dict[FailureKind, int] = dict.fromkeys(FailureKind, 0)
        self.writes_cancelled = 0
        self.writes_abandoned = 0
        self.bytes_written = 0
        self.notifications = 0

    # ---------------------------------------------------------------- set-up

    @property
    def kind(self) -> str:
        return self._kind

    @property
    def name(self) -> str:
        return self._name

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    @property
    def in_flight(self) -> int:
        """Transfers the backend has not ended: their destinations may still be written."""
        with self._lock:
            return sum(len(p.reads) for p in self._all_peers())

    @property
    def abandoned_in_flight(self) -> int:
        """Of `in_flight`, those released by their caller (kept until they end)."""
        with self._lock:
            return len(self._abandoned)

    def register(self, address: int, size: int) -> None:
        if address <= 0 or size <= 0:
            raise ValueError(f"bad region {address:#x}+{size}")
        with self._lock:
            self._check_open()
            if self._region == (address, size):
                return  # one node's Producer and Consumer share its transport and region
            if self._region is not None:
                raise TransportError("another region is already registered")
            self._register(address, size)
            self._region = (address, size)

    def local_info(self) -> PeerInfo:
        with self._lock:
            self._check_open()
            if self._region is None:
                raise TransportError("no region registered")
            return PeerInfo(
                kind=self._kind,
                agent_name=self._name,
                agent_metadata=self._metadata(),
                region_address=self._region[0],
                region_size=self._region[1],
            )

    def add_peer(self, info: PeerInfo) -> str:
        """Load a peer; a known name with new metadata (a restarted peer) replaces
        it once its transfers have ended, and is refused until then."""
        if info.kind != self._kind:
            raise ValueError(f"peer data plane is {info.kind!r}, not {self._kind!r}")
        if not info.agent_name or info.agent_name == self._name:
            raise ValueError(f"bad peer agent name {info.agent_name!r}")
        if info.region_address <= 0 or info.region_size <= 0:
            raise ValueError("peer region is empty")
        with self._lock:
            self._check_open()
            name = info.agent_name
            known = self._peers.get(name) or self._retired.get(name)
            if known is not None and known.info == info:
                # The same registration again (a re-handshake): keep the peer and
                # any transfers still moving, which stay pollable to their end.
                self._retired.pop(name, None)
                self._peers[name] = known
                return name
            return self._load(info, known)

    def remove_peer(self, name: str) -> None:
        """Forget a peer (idempotent): new transfers to it fail NOT_FOUND at once.

        Its transfers in flight are not failed: they stay PENDING until the
        backend ends them, and the peer stays loaded (retired) until then.
        """
        with self._lock:
            if self._closed:
                return
            peer = self._peers.pop(name, None)
            if peer is None:
                return
            if peer.reads:
                self._retired[name] = peer
            else:
                self._unload(name, peer)

    # ------------------------------------------------------------- transfers

    def read(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> H:
        return self._post("READ", peer, segments, notify)

    def write(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> H:
        """Start writing our `local_offset`s to the peer's `remote_offset`s (a push).

        Every rule of `read` holds, directions swapped: our source may still be
        read, and the peer's destination written, until `poll` answers DONE or
        FAILED, and a released PENDING write is abandoned, not stopped.
        `notify` reaches the peer's `progress` once the data has landed.
        """
        return self._post("WRITE", peer, segments, notify)

    def note(self, peer: str, message: bytes) -> bool:
        """Send `message` to `peer`'s `progress`, bound to no transfer; False where it could
        not be sent (an unknown peer, or one removed and unloaded; a closed transport; the
        backend's refusal). A removed peer still loaded for its transfers is sent to.

        A writer that waits for its write's DONE and then calls this tells the peer what
        `write(..., notify=...)` would, at the same point or later: the data has landed.
        It does not make the write's DONE wait for the peer to take the message, as a
        write's own notification does where the backend sends it only after the write has
        completed (NIXL's UCX backend: the write is DONE only once the peer has progressed).
        """
        with self._lock:
            if self._closed:
                return False
            p = self._peers.get(peer) or self._retired.get(peer)
            if p is None:
                return False
            return self._send_note(p, bytes(message))

    def release(self, handle: ReadHandle) -> None:
        """The caller is done with a transfer. A PENDING one is abandoned, not stopped.

        No backend can stop a transfer it has posted (see nixl.py), so an
        abandoned one keeps moving, driven by `progress` and `poll`, and counts
        as cancelled once it has ended. Until `poll` stops answering PENDING its
        destination may still be written.
        """
        handle = self._ours(handle)
        with self._lock:
            if handle.status.state is ReadState.PENDING and not handle.abandoned:
                handle.abandoned = True
                if handle.op == "WRITE":
                    self.writes_abandoned += 1
                else:
                    self.reads_abandoned += 1
                self._abandoned.add(handle)

    def __enter__(self: L) -> L:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        peers = len(self._peers)
        return f"{type(self).__name__}({self._name!r}, peers={peers}, closed={self._closed})"

    @abc.abstractmethod
    def close(self) -> None: ...

    # -------------------------------------------------------- the backend's part

    def _register(self, address: int, size: int) -> None:
        """Hand the region to the backend; nothing to do unless it must know it."""

    @abc.abstractmethod
    def _metadata(self) -> bytes:
        """What a peer loads to reach us (`PeerInfo.agent_metadata`)."""

    @abc.abstractmethod
    def _load(self, info: PeerInfo, known: P | None) -> str:
        """Load a peer not known by this `info`; `known` is the one under its name."""

    @abc.abstractmethod
    def _handle(self, op: str, peer: str, segments: Sequence[Segment]) -> H: ...

    @abc.abstractmethod
    def _launch(self, handle: H, peer: P, segments: Sequence[Segment], notify: bytes) -> None:
        """Post a checked transfer; it joins `peer.reads` unless it has already ended."""

    @abc.abstractmethod
    def _send_note(self, peer: P, message: bytes) -> bool:
        """Send a message bound to no transfer to a loaded peer (`note`)."""

    def _let_go(self, handle: H) -> None:
        """The backend's part of an ended transfer goes."""

    def _unload(self, name: str, peer: P | None = None) -> P | None:
        """Drop a peer with no transfers in flight; returns it."""
        known = self._peers.pop(name, None) or self._retired.pop(name, None)
        peer = peer or known
        if peer is not None:
            assert not peer.reads, f"{name} unloaded with reads in flight"
        return peer

    # --------------------------------------------------------------- private

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def _ours(self, handle: ReadHandle) -> H:
        if not isinstance(handle, self._handle_type):
            raise TypeError(f"not a {type(self).__name__} read: {handle!r}")
        return cast(H, handle)

    def _all_peers(self) -> list[P]:
        return [*self._peers.values(), *self._retired.values()]

    def _make_way(self, name: str, known: P | None) -> None:
        """Unload `known` for new metadata under `name`; refused while its transfers run."""
        if known is None:
            return
        if known.reads:
            raise TransportError(
                f"{len(known.reads)} reads of the previous registration of {name!r} "
                "are still in flight; try again once they have ended"
            )
        self._unload(name)

    def _post(self, op: str, peer: str, segments: Sequence[Segment], notify: bytes) -> H:
        with self._lock:
            self._check_open()
            if self._region is None:
                raise TransportError("no region registered")
            if op == "WRITE":
                self.writes_started += 1
            else:
                self.reads_started += 1
            handle = self._handle(op, peer, segments)
            p = self._peers.get(peer)
            if p is None:
                self._finish(handle, FailureKind.NOT_FOUND, f"unknown peer {peer!r}")
                return handle
            why = out_of_bounds(segments, self._region[1], p.info.region_size)
            if why:
                self._finish(handle, FailureKind.INVALID, why)
                return handle
            self._launch(handle, p, segments, notify)
            return handle

    def _done(self, handle: H) -> None:
        if handle.abandoned:
            self._cancelled(handle)
        elif handle.op == "WRITE":
            self.writes_done += 1
            self.bytes_written += handle.nbytes
        else:
            self.reads_done += 1
            self.bytes_read += handle.nbytes
        handle.status = DONE
        self._ended(handle)

    def _finish(self, handle: H, kind: FailureKind, detail: str) -> None:
        if handle.abandoned:
            self._cancelled(handle)
        elif handle.op == "WRITE":
            self.writes_failed[kind] += 1
        else:
            self.reads_failed[kind] += 1
        handle.status = ReadStatus(ReadState.FAILED, kind, detail)
        self._ended(handle)

    def _cancelled(self, handle: H) -> None:
        if handle.op == "WRITE":
            self.writes_cancelled += 1
        else:
            self.reads_cancelled += 1

    def _ended(self, handle: H) -> None:
        """The backend has ended `handle`: its destination is the caller's again."""
        peer = self._peers.get(handle.peer) or self._retired.get(handle.peer)
        if peer is not None:
            peer.reads.discard(handle)
            if not peer.reads and self._retired.get(handle.peer) is peer:
                del self._retired[handle.peer]
                self._unload(handle.peer, peer)
        self._abandoned.discard(handle)
        self._let_go(handle)

    def _end_all(self, detail: str) -> None:
        """Fail every transfer not yet ended: the backend is going (closing)."""
        for peer in self._all_peers():
            for handle in list(peer.reads):
                self._finish(handle, FailureKind.BACKEND, detail)
