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
from ecshare.transport.ledger import Handle, Ledger, Peer

__all__ = ["DEFAULT_FABRIC", "Completion", "Fabric", "LoopbackRead", "LoopbackTransport"]

KIND = "loopback"


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


class LoopbackRead(Handle):
    """One transfer (a read, or a write); opaque to callers, who pass it back to
    `poll` and `release`."""

    __slots__ = (
        "fault",
        "moved",
        "notify",
        "reader",
        "segments",
        "steps",
        "steps_done",
        "target",
        "told",
    )

    def __init__(
        self, reader: LoopbackTransport, peer: str, segments: Sequence[Segment], op: str
    ) -> None:
        super().__init__(peer, sum(s.length for s in segments), op)
        self.reader = reader  # the initiator, whether it reads or writes
        self.segments = tuple(segments)
        self.target: LoopbackTransport | None = None
        self.notify = b""
        self.fault: _Fault | None = None
        self.moved = 0  # bytes written so far, in segment order
        self.steps = 0
        self.steps_done = 0
        self.told = False  # its notification is queued at the target


class _Peer(Peer[LoopbackRead]):
    __slots__ = ("target",)

    def __init__(self, info: PeerInfo, target: LoopbackTransport) -> None:
        super().__init__(info)
        self.target = target


class LoopbackTransport(Ledger[LoopbackRead, _Peer]):
    """`DataTransport` between regions of one process; see the module docstring.

    Its counters, transfer lives and peer retirement are the `Ledger`'s
    (ledger.py), as NixlTransport's are: once `in_flight` is 0,
    ``reads_started == reads_done + sum(reads_failed.values()) + reads_cancelled``,
    and the same for `writes_*`. `in_flight` counts reads and writes.
    """

    _kind = KIND
    _handle_type = LoopbackRead

    def __init__(
        self,
        name: str,
        *,
        fabric: Fabric | None = None,
        completion: Completion = Completion.SYNC,
        steps: int = 1,
    ) -> None:
        """`steps` (>= 1): drives a POLLED or TARGET read takes to complete."""
        self._fabric = fabric if fabric is not None else DEFAULT_FABRIC
        super().__init__(name, self._fabric.lock)
        if steps < 1:
            raise ValueError("steps must be >= 1")
        self._completion = completion
        self._steps = 0 if completion is Completion.SYNC else steps
        self._inbound: list[LoopbackRead] = []  # reads from us, in the order they were posted
        self._notes: list[tuple[str, bytes]] = []  # notifications not yet handed out
        self._faults: list[_Fault] = []
        self._stalled = False
        self._killed = False
        with self._lock:
            self._token = self._fabric._join(self)

    @property
    def self_progressing(self) -> bool:
        return self._completion is not Completion.TARGET

    @property
    def may_copy_in_call(self) -> bool:
        return True  # from a SYNC target

    @property
    def unreleased(self) -> int:
        """Always 0: nothing here can refuse a release (NixlTransport's counter)."""
        return 0

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

    def poll(self, handle: ReadHandle) -> ReadStatus:
        handle = self._ours(handle)
        with self._lock:
            target = handle.target
            if (
                handle.status.state is ReadState.PENDING
                and target is not None
                and target._completion is not Completion.TARGET
            ):
                target._drive(handle)
            return handle.status

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

    # ------------------------------------------------------ the Ledger's hooks
    # Everything below runs under the fabric's lock.

    def _metadata(self) -> bytes:
        return self._token

    def _load(self, info: PeerInfo, known: _Peer | None) -> str:
        name = info.agent_name
        target = self._fabric._resolve(bytes(info.agent_metadata))
        if target is None:
            raise TransportError(f"cannot load metadata of {name!r}: not a loopback agent")
        if target.name != name:
            raise ValueError(f"metadata is for {target.name!r}, not {name!r}")
        self._make_way(name, known)
        self._peers[name] = _Peer(info, target)
        return name

    def _handle(self, op: str, peer: str, segments: Sequence[Segment]) -> LoopbackRead:
        return LoopbackRead(self, peer, segments, op)

    def _launch(
        self, handle: LoopbackRead, p: _Peer, segments: Sequence[Segment], notify: bytes
    ) -> None:
        target = p.target
        if target._closed:
            self._finish(handle, FailureKind.PEER_DISCONNECTED, f"{handle.peer} is gone")
            return
        # The peer's claim was checked already; what it registered is the real limit.
        real = target._region[1] if target._region else 0
        if any(s.remote_offset + s.length > real for s in segments):
            self._finish(handle, FailureKind.NOT_FOUND, f"memory of {handle.peer} not registered")
            return
        handle.target = target
        handle.notify = bytes(notify)
        handle.fault = self._take_fault(handle.peer)
        handle.steps = target._steps
        p.reads.add(handle)
        target._inbound.append(handle)
        if target._completion is not Completion.TARGET:
            target._drive(handle)

    def _send_note(self, peer: _Peer, message: bytes) -> bool:
        target = peer.target
        if target._closed:
            return False
        target._notes.append((self._name, message))
        return True

    def _let_go(self, handle: LoopbackRead) -> None:
        handle.told = False
        target = handle.target
        if target is not None and handle in target._inbound:
            target._inbound.remove(handle)

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is killed" if self._killed else "transport is closed")

    # ---------------------------------------------------------------- physics

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

    def _shut(self, how: str) -> None:
        for handle in list(self._inbound):
            handle.reader._finish(handle, FailureKind.PEER_DISCONNECTED, f"{self._name} {how}")
        self._end_all(f"transport {how}")
        self._peers.clear()
        self._retired.clear()
        self._notes.clear()
        self._faults.clear()
        self._region = None
        self._closed = True


if TYPE_CHECKING:

    def _implements(t: LoopbackTransport) -> WritingTransport:
        return t
