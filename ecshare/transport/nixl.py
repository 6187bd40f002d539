"""The NIXL data plane: READ a peer's registered region into our own.

Progress. Over TCP a READ moves only as the target progresses (about 1 ms per
64 KiB with the target polling every 1 ms, 0.2 ms when it polls busily). On
one host UCX uses cross memory attach and a READ completes inside `read`
itself, without the target, except the first READ to a newly added peer:
connection wire-up needs the target to progress once. Two ways to progress:

- ``progress_thread=True``: NIXL's own progress thread, made to sleep. NIXL's
  Python wrapper creates its agent with ``pthrDelay = 0``, and the thread then
  polls the UCX worker's event fd with a zero timeout: a busy spin of one core.
  We create it with a timeout instead (`_PROGRESS_THREAD_WAKE_US`), so it
  sleeps in ``poll`` until UCX has an event (a TCP segment, a wire-up message)
  and progresses then, in C++, without the GIL; the timeout is only the
  fallback wake-up of an idle thread. Measured here over UCX_TLS=tcp, a target
  idle 5 ms before each READ: 64 KiB in 0.25 ms, 1 MiB in 1.3 ms, 16 MiB in
  17 ms, against 4.8, 2.9 and 49 ms with the target polling every 0.2 ms from
  Python; idle, the target process spends 0.3% of a core (0.8% with a 10 ms
  timeout; a 1 ms timeout is slower and costlier: 3%). `self_progressing` is
  True, and `progress` is needed only to collect notifications.
- ``progress_thread=False``: our calls drive progress. The initiator
  progresses in `poll`; the target must call `progress` often while peers may
  be reading from it. Tests that stall a producer's data plane do it by
  holding back those calls, so they use this mode.

Notifications. `read(..., notify=msg)` makes NIXL deliver `msg` to the target's
`progress` exactly once after the data has moved. The read is DONE only when
the target has taken the notification, one round trip through the target's
progress loop (about 1 ms with a 1 ms poll, against 0.05 ms without notify
for 64 KiB). A consumer normally reports completion on the control plane
instead and leaves `notify` empty.

Blocking. Over cross memory attach the copy runs synchronously inside `read`
(about 1.2 ms for 16 MiB, 6 ms for 64 MiB). Never call `read` on a thread an
engine waits on.

Threads. Every call into the agent is made under one lock, so the object may
be shared by threads (for example a producer's progress loop and a consumer's
fetch loop in one instance). A synchronous read holds the lock for its copy,
so such a progress loop stalls for that long.

Lifetimes. A read's destination may be written until the backend itself
says the read has ended: `check_xfer_state` reports DONE or an error on a
handle we still hold, or the agent is destroyed (`close`). Nothing local
counts. Measured over UCX_TLS=tcp against a producer paused for 1 s: after
`release_xfer_handle` of a PROC transfer (UCX cannot cancel an RMA get:
`ucp_request_cancel` leaves it running and `ucp_request_free` only drops our
reference) and after `remove_remote_agent` (the endpoint closes in flush mode,
which waits for the get), 8,356,098 of 8 MiB still landed once the producer
resumed. NIXL also answers NOT_FOUND for every transfer to a remote it no
longer knows, without asking the backend. So this class never lets go of a
pending transfer: `release` of a PENDING read abandons it (the transport
keeps polling it, and `poll` keeps answering PENDING until it has ended), and
`remove_peer` only retires the peer: new reads to it fail at once, while the
remote agent stays loaded until its last read has ended. A re-added peer with
the same metadata takes its retired reads back; new metadata under a name
whose reads are still in flight is refused. A peer frozen forever keeps its
reads pending forever: the destination leaks (counted in `in_flight` and
`abandoned_in_flight`), it is never reused. The one exception is a failed
post (`transfer` raising): NIXL then cancels what it had posted itself, and
we can only take its word, which comes with the endpoint's failure.

Writes. `write` is the same transfer in the other direction (push): the
local segments are the source, the peer's the destination, and every rule
above holds for it unchanged. The source must stay as it is until `poll`
answers DONE or FAILED (the backend may still be reading it), and the
destination, in the peer's memory, may be written until then. The target has
no handle of its own: the only word it gets from its own backend is the
write's notification, delivered exactly once after the data has landed, and a
write that fails brings none, so the initiator must report the end it saw.

Descriptors. Each read goes through `initialize_xfer` by default. With
`prepared_block_size` set, both regions are also prepared once (one
descriptor per block) and reads whose segments are all block-aligned use
`make_prepped_xfer` by index; others still use `initialize_xfer`. Measured
here (`benchmarks/nixl_descriptors.py`), preparing saves about 2 us per read
(read + poll + release of one 64 KiB descriptor: 15.6 against 13.7 us), under
2% from 1 MiB up, where the copy dominates. It is off by default: the gain is
small against items of megabytes, and it ties reads to a block grid.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

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

__all__ = ["NixlRead", "NixlTransport", "merge_segments"]

log = logging.getLogger(__name__)

KIND = "nixl"
_INSTALL_HINT = "NIXL is not installed: pip install 'ecshare[nixl]' (nixl-cu12)"
_PENDING = ReadStatus(ReadState.PENDING)
_DONE = ReadStatus(ReadState.DONE)
# UCX reads its configuration from the environment when a backend is created;
# agents created concurrently with different settings must not interleave.
_ENV_LOCK = threading.Lock()
# How long NIXL's progress thread sleeps in poll() on the UCX worker's event fd
# when no event comes (see the module docstring): a fallback, not a poll rate.
_PROGRESS_THREAD_WAKE_US = 100_000


def _import_nixl() -> Any:
    try:
        import nixl._api as nixl_api
    except ImportError as e:
        raise TransportError(_INSTALL_HINT) from e
    # NIXL logs every agent creation at INFO to stdout, which would mix with a
    # program's own output; NIXL_LOG_LEVEL still overrides this.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_api


@contextlib.contextmanager
def _environ(overrides: Mapping[str, str]) -> Iterator[None]:
    with _ENV_LOCK:
        saved = {k: os.environ.get(k) for k in overrides}
        os.environ.update(overrides)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v


def _create_agent(nixl_api: Any, name: str, config: Any) -> Any:
    """`nixl_agent(name, config)`, its progress thread (if on) sleeping between events.

    The wrapper sets ``pthrDelay = 0`` on the agent config it builds, with no way
    to pass another value, so for the length of the call its module's
    ``nixlBind`` is a stand-in that sets our timeout on that config on its way
    to the real ``nixlAgent`` (every other name passes straight through). If the
    wrapper ever builds its agent another way, the stand-in is not reached and
    we refuse the agent rather than run a spinning thread.
    """
    if not config.enable_pthread:
        return nixl_api.nixl_agent(name, config)
    real = nixl_api.nixlBind
    applied: list[bool] = []

    class _Bind:
        def __getattr__(self, attr: str) -> Any:
            return getattr(real, attr)

        def nixlAgent(self, agent_name: str, agent_config: Any) -> Any:
            agent_config.pthrDelay = _PROGRESS_THREAD_WAKE_US
            applied.append(True)
            return real.nixlAgent(agent_name, agent_config)

    # Called under _ENV_LOCK, like every agent's creation, so no two swaps overlap.
    nixl_api.nixlBind = _Bind()
    try:
        agent = nixl_api.nixl_agent(name, config)
    finally:
        nixl_api.nixlBind = real
    if not applied:
        raise TransportError(
            "this NIXL build creates its agent in a way ecshare cannot give a progress-thread "
            "timeout, and its thread would spin a core: set nixl_progress_thread=false"
        )
    return agent


def merge_segments(segments: Sequence[Segment]) -> list[Segment]:
    """Join neighbours that are contiguous on both sides, keeping the order."""
    merged: list[Segment] = []
    for s in segments:
        if merged:
            p = merged[-1]
            if (
                p.local_offset + p.length == s.local_offset
                and p.remote_offset + p.length == s.remote_offset
            ):
                merged[-1] = Segment(p.local_offset, p.remote_offset, p.length + s.length)
                continue
        merged.append(s)
    return merged


def _out_of_bounds(segments: Sequence[Segment], local_size: int, remote_size: int) -> str:
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


class NixlRead:
    """One transfer (a read, or a write); opaque to callers, who pass it back to
    `poll` and `release`."""

    __slots__ = ("_xfer", "abandoned", "nbytes", "op", "peer", "status")

    def __init__(self, peer: str, nbytes: int, op: str = "READ") -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.op = op
        self.status = _PENDING
        self.abandoned = False  # released while PENDING: its end counts as cancelled
        self._xfer: Any = None  # the NIXL handle while it is ours to release

    def __repr__(self) -> str:
        return (
            f"NixlRead({self.op}, peer={self.peer!r}, nbytes={self.nbytes}, "
            f"{self.status.state.value})"
        )


def _ours(handle: ReadHandle) -> NixlRead:
    if not isinstance(handle, NixlRead):
        raise TypeError(f"not a NixlTransport read: {handle!r}")
    return handle


class _Peer:
    __slots__ = ("info", "prepped", "reads")

    def __init__(self, info: PeerInfo) -> None:
        self.info = info
        self.prepped: Any = None
        self.reads: set[NixlRead] = set()  # PENDING reads: the backend has not ended them


class NixlTransport:
    """`DataTransport` over one NIXL agent with one registered DRAM region.

    Nothing NIXL raises escapes `read`, `poll`, `release` or `progress`: a
    failure becomes a FAILED status with a `FailureKind`, and segments outside
    either region fail as INVALID before any memory is touched. Local misuse
    (no region registered, transport closed) raises `TransportError`.

    Counters: every read ends exactly once, so
    ``reads_started == reads_done + sum(reads_failed.values()) + reads_cancelled``
    once `in_flight` is 0. A read released while PENDING counts in
    `reads_abandoned` at once and in `reads_cancelled` when it has ended.
    Writes keep the same books under `writes_*` (and `bytes_written`).
    """

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = False,
        num_threads: int = 0,
        ucx_env: Mapping[str, str] | None = None,
        prepared_block_size: int = 0,
    ) -> None:
        """`ucx_env` (e.g. ``{"UCX_TLS": "tcp"}``) is applied while the agent is
        created only. `prepared_block_size` > 0 turns on prepared descriptor lists."""
        if not name:
            raise ValueError("agent name must not be empty")
        if prepared_block_size < 0:
            raise ValueError("prepared_block_size must be >= 0")
        nixl_api = _import_nixl()
        bind = nixl_api.nixlBind
        self._errors: tuple[tuple[type[BaseException], FailureKind], ...] = (
            (bind.nixlRemoteDisconnectError, FailureKind.PEER_DISCONNECTED),
            (bind.nixlNotFoundError, FailureKind.NOT_FOUND),
            (bind.nixlInvalidParamError, FailureKind.INVALID),
        )
        config = nixl_api.nixl_agent_config(
            enable_prog_thread=progress_thread,
            backends=list(backends),
            num_threads=num_threads,
        )
        try:
            with _environ(ucx_env or {}):
                self._agent: Any = _create_agent(nixl_api, name, config)
        except Exception as e:
            raise TransportError(f"cannot create NIXL agent {name!r}: {e}") from e
        missing = [b for b in backends if b not in self._agent.backends]
        if missing or not self._agent.backends:
            raise TransportError(f"NIXL backends not available: {missing or list(backends)}")
        self._self_progressing = progress_thread
        self._name = name
        self._lock = threading.Lock()
        self._block = prepared_block_size
        self._region: tuple[int, int] | None = None
        self._reg_descs: Any = None
        self._local_prepped: Any = None
        self._peers: dict[str, _Peer] = {}
        # Removed peers whose reads have not ended yet; their agents stay loaded.
        self._retired: dict[str, _Peer] = {}
        self._abandoned: set[NixlRead] = set()  # released while PENDING, still running
        self._unreleased: list[Any] = []  # NIXL handles that refused to be released
        self._closed = False

        self.reads_started = 0
        self.reads_done = 0
        self.reads_failed: dict[FailureKind, int] = dict.fromkeys(FailureKind, 0)
        self.reads_cancelled = 0
        self.reads_abandoned = 0
        self.reads_prepped = 0
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
        """NIXL's progress thread moves reads from us; `progress` only collects notices."""
        return self._self_progressing

    @property
    def in_flight(self) -> int:
        """Reads the backend has not ended: their destinations may still be written."""
        with self._lock:
            return sum(len(p.reads) for p in (*self._peers.values(), *self._retired.values()))

    @property
    def abandoned_in_flight(self) -> int:
        """Of `in_flight`, those released by their caller (kept until they end)."""
        with self._lock:
            return len(self._abandoned)

    @property
    def unreleased(self) -> int:
        """NIXL transfers whose release failed; retried by `progress` and `close`."""
        return len(self._unreleased)

    def register(self, address: int, size: int) -> None:
        if address <= 0 or size <= 0:
            raise ValueError(f"bad region {address:#x}+{size}")
        with self._lock:
            self._check_open()
            if self._region == (address, size):
                return  # one node's Producer and Consumer share its transport and region
            if self._region is not None:
                raise TransportError("another region is already registered")
            try:
                self._reg_descs = self._agent.register_memory([(address, size, 0, "")], "DRAM")
                if self._block:
                    self._local_prepped = self._agent.prep_xfer_dlist(
                        "NIXL_INIT_AGENT", self._blocks(address, size), "DRAM"
                    )
            except Exception as e:
                raise TransportError(f"cannot register region: {e}") from e
            self._region = (address, size)

    def local_info(self) -> PeerInfo:
        with self._lock:
            self._check_open()
            if self._region is None:
                raise TransportError("no region registered")
            return PeerInfo(
                kind=KIND,
                agent_name=self._name,
                agent_metadata=bytes(self._agent.get_agent_metadata()),
                region_address=self._region[0],
                region_size=self._region[1],
            )

    def add_peer(self, info: PeerInfo) -> str:
        """Load a peer; a known name is replaced (a restarted peer), failing its reads."""
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
                # The same registration again (a re-handshake): keep the agent and
                # any reads still moving, which stay pollable to their end.
                self._retired.pop(name, None)
                self._peers[name] = known
                return name
            if known is not None:
                if known.reads:
                    raise TransportError(
                        f"{len(known.reads)} reads of the previous registration of {name!r} "
                        "are still in flight; try again once they have ended"
                    )
                self._unload(name)
            try:
                loaded = self._agent.add_remote_agent(info.agent_metadata)
            except Exception as e:
                raise TransportError(f"cannot load metadata of {info.agent_name!r}: {e}") from e
            loaded = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if loaded != info.agent_name:
                other = self._peers.get(loaded) or self._retired.get(loaded)
                if other is None:
                    self._forget_agent(loaded)
                else:  # another peer's metadata: keep that peer working
                    self._quietly(self._agent.add_remote_agent, other.info.agent_metadata)
                raise ValueError(f"metadata is for {loaded!r}, not {info.agent_name!r}")
            peer = _Peer(info)
            self._peers[loaded] = peer
            if self._block:
                try:
                    peer.prepped = self._agent.prep_xfer_dlist(
                        loaded, self._blocks(info.region_address, info.region_size), "DRAM"
                    )
                except Exception as e:
                    self._unload(loaded)
                    raise TransportError(f"cannot prepare descriptors of {loaded!r}: {e}") from e
            return loaded

    def remove_peer(self, name: str) -> None:
        """Forget a peer (idempotent): new reads from it fail as NOT_FOUND at once.

        Its pending reads are not failed: they stay PENDING until the backend
        ends them, and the peer's agent stays loaded until then.
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

    # ----------------------------------------------------------------- reads

    def read(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> NixlRead:
        return self._post("READ", peer, segments, notify)

    def write(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> NixlRead:
        """Start writing our `local_offset`s to the peer's `remote_offset`s.

        Every rule of `read` holds: the source may be read by the backend until
        `poll` answers DONE or FAILED, and a released PENDING write is abandoned,
        not stopped. `notify` reaches the peer's `progress` once the data has landed.
        """
        return self._post("WRITE", peer, segments, notify)

    def _post(self, op: str, peer: str, segments: Sequence[Segment], notify: bytes) -> NixlRead:
        with self._lock:
            self._check_open()
            if self._region is None:
                raise TransportError("no region registered")
            if op == "WRITE":
                self.writes_started += 1
            else:
                self.reads_started += 1
            handle = NixlRead(peer, sum(s.length for s in segments), op)
            p = self._peers.get(peer)
            if p is None:
                self._finish(handle, FailureKind.NOT_FOUND, f"unknown peer {peer!r}")
                return handle
            laddr, lsize = self._region
            why = _out_of_bounds(segments, lsize, p.info.region_size)
            if why:
                self._finish(handle, FailureKind.INVALID, why)
                return handle
            merged = merge_segments(segments)
            try:
                handle._xfer = self._create(p, merged, laddr, notify, op)
                state = self._agent.transfer(handle._xfer)
            except Exception as e:
                self._finish(handle, *self._failure(e))
                return handle
            p.reads.add(handle)
            self._settle(handle, state)
            return handle

    def poll(self, handle: ReadHandle) -> ReadStatus:
        """DONE or FAILED only on the backend's word that the read has ended."""
        handle = _ours(handle)
        with self._lock:
            self._check(handle)
            return handle.status

    def release(self, handle: ReadHandle) -> None:
        """The caller is done with a read. A PENDING one is abandoned, not freed.

        No backend can stop a read it has posted (see the module docstring), so
        an abandoned read keeps its NIXL transfer, is driven by `progress` and
        `poll`, and counts as cancelled once the backend has ended it. Until
        `poll` stops answering PENDING its destination may still be written.
        """
        handle = _ours(handle)
        with self._lock:
            if handle.status.state is not ReadState.PENDING:
                self._release_xfer(handle)
            elif not handle.abandoned:
                handle.abandoned = True
                if handle.op == "WRITE":
                    self.writes_abandoned += 1
                else:
                    self.reads_abandoned += 1
                self._abandoned.add(handle)

    def progress(self) -> list[tuple[str, bytes]]:
        """Drive target-side progress; cheap enough to call every millisecond."""
        with self._lock:
            if self._closed:
                return []
            if self._unreleased:
                self._retry_unreleased()
            for handle in list(self._abandoned):
                self._check(handle)
            try:
                notifs = self._agent.get_new_notifs()
            except Exception as e:
                log.warning("NIXL progress failed: %s", e)
                return []
            out = [
                (k.decode() if isinstance(k, bytes) else str(k), bytes(m))
                for k, msgs in notifs.items()
                for m in msgs
            ]
            self.notifications += len(out)
            return out

    def close(self) -> None:
        """Fail pending reads, forget peers, deregister the region (idempotent)."""
        with self._lock:
            if self._closed:
                return
            peers = [*self._peers.values(), *self._retired.values()]
            for peer in peers:
                for handle in list(peer.reads):
                    # Destroying the agent below ends them: no worker is left to write.
                    self._finish(handle, FailureKind.BACKEND, "transport closed")
            for name in [*self._peers, *self._retired]:
                self._unload(name)
            self._retry_unreleased()
            if self._unreleased:
                log.warning("closing with %d unreleased NIXL transfers", len(self._unreleased))
                self._unreleased = []
            if self._local_prepped is not None:
                self._quietly(self._agent.release_dlist_handle, self._local_prepped)
                self._local_prepped = None
            if self._reg_descs is not None:
                self._quietly(self._agent.deregister_memory, self._reg_descs)
                self._reg_descs = None
            self._closed = True
            self._agent = None

    def __enter__(self) -> NixlTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NixlTransport({self._name!r}, peers={len(self._peers)}, closed={self._closed})"

    # --------------------------------------------------------------- private

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("transport is closed")

    def _blocks(self, address: int, size: int) -> np.ndarray[Any, np.dtype[np.uint64]]:
        n = size // self._block
        rows = np.zeros((n, 3), dtype=np.uint64)
        rows[:, 0] = np.arange(n, dtype=np.uint64) * np.uint64(self._block) + np.uint64(address)
        rows[:, 1] = self._block
        return rows

    def _create(
        self, peer: _Peer, merged: list[Segment], laddr: int, notify: bytes, op: str
    ) -> Any:
        b = self._block
        if peer.prepped is not None and all(
            s.local_offset % b == 0 and s.remote_offset % b == 0 and s.length % b == 0
            for s in merged
        ):
            # An aligned segment inside a region ends on a whole block, so all are prepared.
            lidx: list[int] = []
            ridx: list[int] = []
            for s in merged:
                lidx.extend(range(s.local_offset // b, (s.local_offset + s.length) // b))
                ridx.extend(range(s.remote_offset // b, (s.remote_offset + s.length) // b))
            self.reads_prepped += 1
            return self._agent.make_prepped_xfer(
                op, self._local_prepped, lidx, peer.prepped, ridx, notify
            )
        raddr = peer.info.region_address
        local = self._agent.get_xfer_descs(
            [(laddr + s.local_offset, s.length, 0) for s in merged], "DRAM"
        )
        remote = self._agent.get_xfer_descs(
            [(raddr + s.remote_offset, s.length, 0) for s in merged], "DRAM"
        )
        return self._agent.initialize_xfer(op, local, remote, peer.info.agent_name, notify)

    def _check(self, handle: NixlRead) -> None:
        if handle.status.state is not ReadState.PENDING or handle._xfer is None:
            return
        try:
            state = self._agent.check_xfer_state(handle._xfer)
        except Exception as e:
            # NIXL answers NOT_FOUND without asking the backend once the remote is
            # invalidated; we never remove an agent with reads in flight, so that
            # happens only after NIXL saw the endpoint fail (a disconnect).
            self._finish(handle, *self._failure(e))
        else:
            self._settle(handle, state)

    def _settle(self, handle: NixlRead, state: str) -> None:
        if state == "DONE":
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
        elif state != "PROC":
            self._finish(handle, FailureKind.BACKEND, f"transfer state {state}")

    def _cancelled(self, handle: NixlRead) -> None:
        if handle.op == "WRITE":
            self.writes_cancelled += 1
        else:
            self.reads_cancelled += 1

    def _finish(self, handle: NixlRead, kind: FailureKind, detail: str) -> None:
        if handle.abandoned:
            self._cancelled(handle)
        elif handle.op == "WRITE":
            self.writes_failed[kind] += 1
        else:
            self.reads_failed[kind] += 1
        handle.status = ReadStatus(ReadState.FAILED, kind, detail)
        self._ended(handle)

    def _ended(self, handle: NixlRead) -> None:
        """The backend has ended `handle`: its destination is the caller's again."""
        peer = self._peers.get(handle.peer) or self._retired.get(handle.peer)
        if peer is not None:
            peer.reads.discard(handle)
            if not peer.reads and self._retired.get(handle.peer) is peer:
                del self._retired[handle.peer]
                self._unload(handle.peer, peer)
        self._abandoned.discard(handle)
        self._release_xfer(handle)

    def _failure(self, e: Exception) -> tuple[FailureKind, str]:
        detail = f"{type(e).__name__}: {e}"
        for cls, kind in self._errors:
            if isinstance(e, cls):
                return kind, detail
        return FailureKind.BACKEND, detail

    def _release_xfer(self, handle: NixlRead) -> None:
        xfer, handle._xfer = handle._xfer, None
        if xfer is not None:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception as e:
                log.warning("NIXL could not release a transfer from %s: %s", handle.peer, e)
                self._unreleased.append(xfer)

    def _retry_unreleased(self) -> None:
        pending, self._unreleased = self._unreleased, []
        for xfer in pending:
            try:
                self._agent.release_xfer_handle(xfer)
            except Exception:
                self._unreleased.append(xfer)

    def _unload(self, name: str, peer: _Peer | None = None) -> None:
        """Drop a peer with no reads in flight, and its agent."""
        known = self._peers.pop(name, None) or self._retired.pop(name, None)
        peer = peer or known
        if peer is not None:
            assert not peer.reads, f"{name} unloaded with reads in flight"
            if peer.prepped is not None:
                self._quietly(self._agent.release_dlist_handle, peer.prepped)
        self._forget_agent(name)

    def _forget_agent(self, name: str) -> None:
        self._quietly(self._agent.remove_remote_agent, name)

    @staticmethod
    def _quietly(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:
            log.warning("NIXL %s failed: %s", getattr(fn, "__name__", fn), e)


if TYPE_CHECKING:

    def _implements(t: NixlTransport) -> WritingTransport:
        return t
