"""An in-process data plane: the `DataTransport` contract, kept without NIXL.

`LoopbackTransport` moves bytes between regions of one process with
`memmove`. It keeps every promise `NixlTransport` makes (held to the same
contract tests, tests/transport/test_transport_contract.py), so that logic
built on a transport (grants, leases, retries, failover) can be tested in
milliseconds and deterministically, and it can make each of the ways a real
data plane misbehaves happen on demand.

Where peers are. Transports find each other in a `Fabric`: agent metadata is
a token the fabric resolves to the transport that published it, so a peer is
added from its `PeerInfo` exactly as over NIXL, and unknown metadata is
refused the same way. Each transport joins `DEFAULT_FABRIC` unless given one;
a test passes its own to stay isolated. One fabric has one lock: every call
of every transport on it is serialised, copies included.

How reads move (`Completion`, a property of the target, as NIXL's physics are):

- ``SYNC``: the bytes move inside `read` (NIXL over cross-memory attach).
- ``POLLED``: the read takes `steps` drives by its reader (`read` itself is
  the first, then each `poll` of it, or the reader's `progress` once it was
  released), and the bytes move a share at each (NIXL reading from a target
  with its own progress thread). `self_progressing` is True for both.
- ``TARGET``: the read moves one step each time the *target* calls `progress`,
  and not otherwise (UCX over TCP, the target driving progress from its loop);
  `self_progressing` is False. A read with a notification is then DONE only
  once the target's `progress` has handed the notification out.

A read that takes several steps writes part of its destination before it is
DONE, as a real transfer does: only DONE says the bytes are all there.

Faults, injected on the transport they concern:

- `stall` / `resume` on a target: no byte moves and no notification is
  delivered while stalled, in any mode (a stopped process, a dead link).
- `kill` on a target: it is gone. Its readers' reads in flight fail
  PEER_DISCONNECTED at once, and so does every later read from it; its
  region is never touched again. A new transport of the same name (a
  restarted peer) publishes new metadata.
- `fail_next(count, kind, peer, torn)` on an initiator: its next `count`
  reads or writes (with `peer`, or any) fail with `kind` when they would have
  completed; `torn` moves half the bytes first, as a transfer that broke
  midway does.

Lifetimes, as in nixl.py: a read's destination may be written until `poll`
answers DONE or FAILED. `release` of a PENDING read abandons it: it goes on
moving (driven by the reader's `progress`, or by its target) and writes its
destination when its target resumes, and it counts as cancelled when it
ends. `remove_peer` retires a peer whose reads are in flight: new reads fail
NOT_FOUND at once, the old ones run to their end, and re-adding the same
metadata takes them back; new metadata under that name is refused until they
have ended. `close` ends every read of this transport and fails those of its
readers, so no byte moves into or out of its region after it returns.

Writes (a push) are the same transfers in the other direction: `write` moves
our `local_offset`s into the peer's `remote_offset`s, moves as reads from that
peer would, is polled, released and abandoned the same way, and counts under
`writes_*` and `bytes_written`. Its notification reaches the peer's
`progress` once the data has landed; a write that fails brings none.
"""

from __future__ import annotations

import ctypes
import enum
import itertools
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ecshare.transport.base import (
    FailureKind,
    PeerInfo,
    ReadHandle,
    ReadState,
    ReadStatus,
    Segment,
    TransportError,
    WritingTransport,
)

__all__ = ["DEFAULT_FABRIC", "Completion", "Fabric", "LoopbackRead", "LoopbackTransport"]

KIND = "loopback"
_PENDING = ReadStatus(ReadState.PENDING)
_DONE = ReadStatus(ReadState.DONE)


class Completion(enum.Enum):
    """How reads from a transport move (see the module docstring)."""

    SYNC = "sync"
    POLLED = "polled"
    TARGET = "target"


class Fabric:
    """The transports that can see each other, and the one lock they share.

    Names need not be unique (two processes may run agents of one name, a
    stopped one and its successor); the metadata token tells them apart.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        # Every transport that joined, dead ones too: a dead peer's metadata
        # still loads (as it does over NIXL), and reads from it fail.
        self._by_token: dict[bytes, LoopbackTransport] = {}
        self._ids = itertools.count(1)

    def _join(self, transport: LoopbackTransport) -> bytes:
        token = f"{KIND}:{id(self):x}:{transport.name}:{next(self._ids)}:{uuid.uuid4().hex}"
        self._by_token[token.encode()] = transport
        return token.encode()

    def _resolve(self, token: bytes) -> LoopbackTransport | None:
        return self._by_token.get(token)


DEFAULT_FABRIC = Fabric()


@dataclass
class _Fault:
    count: int
    kind: FailureKind
    peer: str | None
    torn: bool


class LoopbackRead:
    """One read; opaque to callers, who pass it back to `poll` and `release`."""

    __slots__ = (
        "abandoned",
        "fault",
        "moved",
        "nbytes",
        "notify",
        "op",
        "peer",
        "reader",
        "segments",
        "status",
        "steps",
        "steps_done",
        "target",
        "told",
    )

    def __init__(
        self, reader: LoopbackTransport, peer: str, segments: Sequence[Segment], op: str
    ) -> None:
        self.reader = reader  # the initiator, whether it reads or writes
        self.op = op
        self.peer = peer
        self.segments = tuple(segments)
        self.nbytes = sum(s.length for s in segments)
        self.status = _PENDING
        self.abandoned = False
        self.target: LoopbackTransport | None = None
        self.notify = b""
        self.fault: _Fault | None = None
        self.moved = 0  # bytes written so far, in segment order
        self.steps = 0
        self.steps_done = 0
        self.told = False  # its notification is queued at the target

    def __repr__(self) -> str:
        return (
            f"LoopbackRead({self.op}, peer={self.peer!r}, nbytes={self.nbytes}, "
            f"{self.status.state.value})"
        )


def _ours(handle: ReadHandle) -> LoopbackRead:
    if not isinstance(handle, LoopbackRead):
        raise TypeError(f"not a LoopbackTransport read: {handle!r}")
    return handle


class _Peer:
    __slots__ = ("info", "reads", "target")

    def __init__(self, info: PeerInfo, target: LoopbackTransport) -> None:
        self.info = info
        self.target = target
        self.reads: set[LoopbackRead] = set()


def _out_of_bounds(segments: Sequence[Segment], local_size: int, remote_size: int) -> str:
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


class LoopbackTransport:
    """`DataTransport` between regions of one process; see the module docstring.

    Counters are NixlTransport's: once `in_flight` is 0,
    ``reads_started == reads_done + sum(reads_failed.values()) + reads_cancelled``,
    and the same for `writes_*`. `in_flight` counts reads and writes.
    """

    def __init__(
        self,
        name: str,
        *,
        fabric: Fabric | None = None,
        completion: Completion = Completion.SYNC,
        steps: int = 1,
    ) -> None:
        """`steps` (>= 1): drives a POLLED or TARGET read takes to complete."""
        if not name:
            raise ValueError("agent name must not be empty")
        if steps < 1:
            raise ValueError("steps must be >= 1")
        self._name = name
        self._fabric = fabric if fabric is not None else DEFAULT_FABRIC
        self._lock = self._fabric.lock
        self._completion = completion
        self._steps = 0 if completion is Completion.SYNC else steps
        self._region: tuple[int, int] | None = None
        self._peers: dict[str, _Peer] = {}
        self._retired: dict[str, _Peer] = {}
        self._abandoned: set[LoopbackRead] = set()
        self._inbound: list[LoopbackRead] = []  # reads from us, in the order they were posted
        self._notes: list[tuple[str, bytes]] = []  # notifications not yet handed out
        self._faults: list[_Fault] = []
        self._stalled = False
        self._killed = False
        self._closed = False
        with self._lock:
            self._token = self._fabric._join(self)

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
        return KIND

    @property
    def name(self) -> str:
        return self._name

    @property
    def peers(self) -> list[str]:
        return list(self._peers)

    @property
    def self_progressing(self) -> bool:
        return self._completion is not Completion.TARGET

    @property
    def in_flight(self) -> int:
        """Reads not ended yet: their destinations may still be written."""
        with self._lock:
            return sum(len(p.reads) for p in (*self._peers.values(), *self._retired.values()))

    @property
    def abandoned_in_flight(self) -> int:
        with self._lock:
            return len(self._abandoned)

    @property
    def unreleased(self) -> int:
        """Always 0: nothing here can refuse a release (NixlTransport's counter)."""
        return 0

    def register(self, address: int, size: int) -> None:
        if address <= 0 or size <= 0:
            raise ValueError(f"bad region {address:#x}+{size}")
        with self._lock:
            self._check_open()
            if self._region == (address, size):
                return
            if self._region is not None:
                raise TransportError("another region is already registered")
            self._region = (address, size)

    def local_info(self) -> PeerInfo:
        with self._lock:
            self._check_open()
            if self._region is None:
                raise TransportError("no region registered")
            return PeerInfo(
                kind=KIND,
                agent_name=self._name,
                agent_metadata=self._token,
                region_address=self._region[0],
                region_size=self._region[1],
            )

    def add_peer(self, info: PeerInfo) -> str:
        """Load a peer; a known name with new metadata replaces it once its reads have ended."""
        if info.kind != KIND:
            raise ValueError(f"peer data plane is {info.kind!r}, not {KIND!r}")
        if not info.agent_name or info.agent_name == self._name:
            raise ValueError(f"bad peer agent name {info.agent_name!r}")
        if info.region_address <= 0 or info.region_size <= 0:
            raise ValueError("peer region is empty")
        with self._lock:
            self._check_open()
            name = info.agent_name
            known = self._peers.get(name) or self._retired.get(name)
            if known is not None and known.info == info:
                self._retired.pop(name, None)
                self._peers[name] = known
                return name
            target = self._fabric._resolve(bytes(info.agent_metadata))
            if target is None:
                raise TransportError(f"cannot load metadata of {name!r}: not a loopback agent")
            if target.name != name:
                raise ValueError(f"metadata is for {target.name!r}, not {name!r}")
            if known is not None:
                if known.reads:
                    raise TransportError(
                        f"{len(known.reads)} reads of the previous registration of {name!r} "
                        "are still in flight; try again once they have ended"
                    )
                self._peers.pop(name, None)
                self._retired.pop(name, None)
            self._peers[name] = _Peer(info, target)
            return name

    def remove_peer(self, name: str) -> None:
        """Forget a peer (idempotent); its reads in flight run to their end."""
        with self._lock:
            if self._closed:
                return
            peer = self._peers.pop(name, None)
            if peer is not None and peer.reads:
                self._retired[name] = peer

    # ----------------------------------------------------------------- faults

    def stall(self) -> None:
        """As a target: move no byte and hand out no notification until `resume`."""
        with self._lock:
            self._stalled = True

    def resume(self) -> None:
        with self._lock:
            self._stalled = False

    def kill(self) -> None:
        """As a target: die. Readers' reads from it fail PEER_DISCONNECTED, now and later."""
        with self._lock:
            if not self._closed:
                self._killed = True
                self._shut("killed")

    def fail_next(
        self,
        count: int = 1,
        kind: FailureKind = FailureKind.BACKEND,
        *,
        peer: str | None = None,
        torn: bool = False,
    ) -> None:
        """As an initiator: the next `count` transfers (with `peer`, or any) fail with `kind`."""
        if count < 1:
            raise ValueError("count must be >= 1")
        with self._lock:
            self._faults.append(_Fault(count, kind, peer, torn))

    # ----------------------------------------------------------------- reads

    def read(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> LoopbackRead:
        return self._post("READ", peer, segments, notify)

    def write(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> LoopbackRead:
        """Start writing our `local_offset`s to the peer's `remote_offset`s (a push).

        Every rule of `read` holds, directions swapped: our source may still be
        read, and the peer's destination written, until `poll` answers DONE or
        FAILED. `notify` reaches the peer's `progress` once the data has landed.
        """
        return self._post("WRITE", peer, segments, notify)

    def _post(self, op: str, peer: str, segments: Sequence[Segment], notify: bytes) -> LoopbackRead:
        with self._lock:
            self._check_open()
            if self._region is None:
                raise TransportError("no region registered")
            if op == "WRITE":
                self.writes_started += 1
            else:
                self.reads_started += 1
            handle = LoopbackRead(self, peer, segments, op)
            p = self._peers.get(peer)
            if p is None:
                self._finish(handle, FailureKind.NOT_FOUND, f"unknown peer {peer!r}")
                return handle
            why = _out_of_bounds(segments, self._region[1], p.info.region_size)
            if why:
                self._finish(handle, FailureKind.INVALID, why)
                return handle
            target = p.target
            if target._closed:
                self._finish(handle, FailureKind.PEER_DISCONNECTED, f"{peer} is gone")
                return handle
            # The peer's claim was checked above; what it registered is the real limit.
            real = target._region[1] if target._region else 0
            if any(s.remote_offset + s.length > real for s in segments):
                self._finish(handle, FailureKind.NOT_FOUND, f"memory of {peer} not registered")
                return handle
            handle.target = target
            handle.notify = bytes(notify)
            handle.fault = self._take_fault(peer)
            handle.steps = target._steps
            p.reads.add(handle)
            target._inbound.append(handle)
            if target._completion is not Completion.TARGET:
                target._drive(handle)
            return handle

    def poll(self, handle: ReadHandle) -> ReadStatus:
        handle = _ours(handle)
        with self._lock:
            target = handle.target
            if (
                handle.status.state is ReadState.PENDING
                and target is not None
                and target._completion is not Completion.TARGET
            ):
                target._drive(handle)
            return handle.status

    def release(self, handle: ReadHandle) -> None:
        """A PENDING read is abandoned: it keeps moving and counts as cancelled when it ends."""
        handle = _ours(handle)
        with self._lock:
            if handle.status.state is ReadState.PENDING and not handle.abandoned:
                handle.abandoned = True
                if handle.op == "WRITE":
                    self.writes_abandoned += 1
                else:
                    self.reads_abandoned += 1
                self._abandoned.add(handle)

    def progress(self) -> list[tuple[str, bytes]]:
        """Drive our abandoned reads and, as a TARGET-mode target, the reads from us;
        hand out the notifications of reads from us."""
        with self._lock:
            if self._closed:
                return []
            for handle in list(self._abandoned):
                target = handle.target
                if target is not None and target._completion is not Completion.TARGET:
                    target._drive(handle)
            if self._stalled:
                return []
            if self._completion is Completion.TARGET:
                for handle in list(self._inbound):
                    self._drive(handle)
            out, self._notes = self._notes, []
            for handle in [h for h in self._inbound if h.told]:
                # A TARGET read with a notification ends once we have taken it.
                handle.reader._done(handle)
            self.notifications += len(out)
            return out

    def close(self) -> None:
        """End our reads, fail our readers' reads from us, leave the fabric (idempotent)."""
        with self._lock:
            if not self._closed:
                self._shut("closed")

    def __enter__(self) -> LoopbackTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"LoopbackTransport({self._name!r}, peers={len(self._peers)}, closed={self._closed})"

    # --------------------------------------------------------------- private
    # Everything below runs under the fabric's lock.

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is killed" if self._killed else "transport is closed")

    def _take_fault(self, peer: str) -> _Fault | None:
        for fault in self._faults:
            if fault.peer is None or fault.peer == peer:
                fault.count -= 1
                if fault.count == 0:
                    self._faults.remove(fault)
                return fault
        return None

    def _drive(self, handle: LoopbackRead) -> None:
        """One step of a read from us: a share of its bytes, and its end after the last."""
        if handle.status.state is not ReadState.PENDING or handle.told or self._stalled:
            return
        reader = handle.reader
        handle.steps_done += 1
        whole = handle.steps_done >= handle.steps
        fault = handle.fault
        if fault is not None:
            if not whole:
                return
            if fault.torn:
                self._move(handle, handle.nbytes // 2)
            reader._finish(handle, fault.kind, f"injected {fault.kind.value} failure")
            return
        if not whole:
            self._move(handle, handle.nbytes * handle.steps_done // handle.steps)
            return
        self._move(handle, handle.nbytes)
        if handle.notify:
            self._notes.append((reader.name, handle.notify))
            if self._completion is Completion.TARGET:
                handle.told = True  # DONE once our progress hands it out
                return
        reader._done(handle)

    def _move(self, handle: LoopbackRead, upto: int) -> None:
        """Copy the transfer's bytes [moved, upto), in segment order."""
        assert self._region is not None and handle.reader._region is not None
        raddr, laddr = self._region[0], handle.reader._region[0]
        writes = handle.op == "WRITE"
        start = 0
        for s in handle.segments:
            lo, hi = max(handle.moved, start), min(upto, start + s.length)
            if lo < hi:
                skip = lo - start
                local, remote = laddr + s.local_offset + skip, raddr + s.remote_offset + skip
                if writes:
                    ctypes.memmove(remote, local, hi - lo)
                else:
                    ctypes.memmove(local, remote, hi - lo)
            start += s.length
        handle.moved = max(handle.moved, upto)

    def _done(self, handle: LoopbackRead) -> None:
        if handle.abandoned:
            self._cancelled(handle)
        elif handle.op == "WRITE":
            self.writes_done += 1
            self.bytes_written += handle.nbytes
        else:
            self.reads_done += 1
            self.bytes_read += handle.nbytes
        handle.status = _DONE
        self._ended(handle)

    def _cancelled(self, handle: LoopbackRead) -> None:
        if handle.op == "WRITE":
            self.writes_cancelled += 1
        else:
            self.reads_cancelled += 1

    def _finish(self, handle: LoopbackRead, kind: FailureKind, detail: str) -> None:
        if handle.abandoned:
            self._cancelled(handle)
        elif handle.op == "WRITE":
            self.writes_failed[kind] += 1
        else:
            self.reads_failed[kind] += 1
        handle.status = ReadStatus(ReadState.FAILED, kind, detail)
        self._ended(handle)

    def _ended(self, handle: LoopbackRead) -> None:
        """`handle` has ended: its destination is the caller's again."""
        handle.told = False
        target = handle.target
        if target is not None and handle in target._inbound:
            target._inbound.remove(handle)
        peer = self._peers.get(handle.peer) or self._retired.get(handle.peer)
        if peer is not None:
            peer.reads.discard(handle)
            if not peer.reads and self._retired.get(handle.peer) is peer:
                del self._retired[handle.peer]
        self._abandoned.discard(handle)

    def _shut(self, how: str) -> None:
        for handle in list(self._inbound):
            handle.reader._finish(handle, FailureKind.PEER_DISCONNECTED, f"{self._name} {how}")
        for peer in [*self._peers.values(), *self._retired.values()]:
            for handle in list(peer.reads):
                self._finish(handle, FailureKind.BACKEND, f"transport {how}")
        self._peers.clear()
        self._retired.clear()
        self._notes.clear()
        self._faults.clear()
        self._region = None
        self._closed = True


if TYPE_CHECKING:

    def _implements(t: LoopbackTransport) -> WritingTransport:
        return t
