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

Keepalive. UCX checks the liveness of an endpoint whose peer may fail
(NIXL asks for that error handling) with keepalive messages on the peer's
active-message lane, TCP here. Once the peer has used its own endpoint back to
us (it reads from us, we write to it), every flush of ours then waits for the
peer's worker to progress, and NIXL flushes each transfer: a cross-memory-attach
READ or WRITE that would end inside the call stays PENDING until the other
process's thread next polls its data plane, 0.1 to 3 ms on this host, or for
as long as that thread sleeps. So agents are created with
``UCX_KEEPALIVE_INTERVAL=inf`` unless the caller or the environment sets it.
Nothing here relies on it: a killed peer still fails its transfers at once
(its sockets close, cross-memory attach finds no process), and a peer that is
alive but silent is found by the control plane's heartbeats and deadlines,
which UCX's keepalive would not shorten (the peer's kernel still answers it).

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

Access. Every peer that loads our metadata (each consumer does, to READ) can WRITE
our region as well: NIXL's UCX backend registers memory with `ucp_mem_map` and no
``prot``, so with every access, and offers no setting for it; nor would one bind
the transports used here, since neither cross-memory attach (``process_vm_writev``)
nor UCX's TCP transport (the target ``recv``s a PUT straight into the address its
header names) checks anything at the target. The region's bounds are checked only
by the initiator's own NIXL, against the metadata it was given: a peer that edits
its copy writes any memory of our process. Both shown between real processes, over
both transports, by tests/security/test_reader_write.py. The region's bytes are therefore
trusted only through a digest held outside it (`ecshare.store.Store.verify`, and
the consumer's checks against the digest a producer told).

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
import importlib.util
import logging
import os
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
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
from ecshare.transport.ledger import Handle, Ledger, Peer

__all__ = ["NixlRead", "NixlTransport", "merge_segments"]

log = logging.getLogger(__name__)

KIND = "nixl"
_INSTALL_HINT = "NIXL is not installed: pip install 'ecshare[nixl]' (nixl-cu12)"
# UCX reads its configuration from the environment when a backend is created;
# agents created concurrently with different settings must not interleave.
_ENV_LOCK = threading.Lock()
# How long NIXL's progress thread sleeps in poll() on the UCX worker's event fd
# when no event comes (see the module docstring): a fallback, not a poll rate.
_PROGRESS_THREAD_WAKE_US = 100_000
_KEEPALIVE = "UCX_KEEPALIVE_INTERVAL"


_CUDA_STACKS = ("torch", "cuda.bindings", "cupy")


def spare_torch_probe() -> None:
    """Spare `import nixl` its import of torch where the answer is known without it.

    The `nixl` package picks its backend (nixl_cu12, ...) by the CUDA version it
    finds; on a CPU build of torch the version file says None, and the package
    then imports all of torch (about 2 s of CPU here) only to read that same None
    again, in every process that uses the data plane. Where no CUDA stack is
    loaded and torch's version file says it has no CUDA (or torch is absent), the
    answer is None without the import, and this gives it; `nixl` then picks the
    first backend installed, as it would have. Any other case is left to `nixl`.
    """
    if "nixl" in sys.modules or any(m in sys.modules for m in _CUDA_STACKS):
        return
    try:
        import nixl_meta_utils as meta
    except ImportError:
        return  # a nixl without this helper module: nothing to spare
    probe = getattr(meta, "detect_cuda_major", None)
    if probe is None or getattr(probe, "ecshare_spared", False) or _torch_cuda_known():
        return

    def detect_cuda_major() -> int | None:
        return probe() if any(m in sys.modules for m in _CUDA_STACKS) else None

    detect_cuda_major.ecshare_spared = True  # type: ignore[attr-defined]
    meta.detect_cuda_major = detect_cuda_major


def _torch_cuda_known() -> bool:
    """Whether torch may name a CUDA version: True unless it is absent, or its version
    file (read alone, torch itself not imported) says `cuda = None`."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        return True
    if spec is None:
        return False  # no torch: nixl's own last resort finds none either
    if not spec.origin:
        return True
    try:
        version_spec = importlib.util.spec_from_file_location(
            "_ecshare_torch_version", Path(spec.origin).parent / "version.py"
        )
        if version_spec is None or version_spec.loader is None:
            return True
        version = importlib.util.module_from_spec(version_spec)
        version_spec.loader.exec_module(version)
    except Exception:
        return True
    return not hasattr(version, "cuda") or version.cuda is not None


def import_nixl_api() -> Any:
    """`nixl._api`, imported without torch where that can be spared (`spare_torch_probe`);
    whatever the import raises, it raises."""
    spare_torch_probe()
    import nixl._api as nixl_api

    # NIXL logs every agent creation at INFO to stdout, which would mix with a
    # program's own output; NIXL_LOG_LEVEL still overrides this.
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return nixl_api


def _import_nixl() -> Any:
    try:
        return import_nixl_api()
    except ImportError as e:
        raise TransportError(_INSTALL_HINT) from e


def may_attach(ucx_tls: str) -> bool:
    """Whether UCX_TLS `ucx_tls` ("" for UCX's default: every transport) lets UCX use
    cross-memory attach or shared memory between processes of one host."""
    names = {n.strip().lower() for n in ucx_tls.lstrip("^").split(",") if n.strip()}
    local = bool(names & {"cma", "sm", "shm", "posix", "sysv", "xpmem", "knem"})
    if ucx_tls.startswith("^"):
        return not names & {"cma", "sm", "shm"}
    return not names or "all" in names or local


def agent_env(ucx_env: Mapping[str, str], *, keepalive: bool = False) -> dict[str, str]:
    """The UCX settings an agent is created under: `ucx_env`, and UCX's endpoint
    keepalive off (``UCX_KEEPALIVE_INTERVAL=inf``) unless `keepalive`, `ucx_env` or the
    process's environment says otherwise (see "Keepalive" in the module docstring)."""
    env = dict(ucx_env)
    if not keepalive and _KEEPALIVE not in env and _KEEPALIVE not in os.environ:
        env[_KEEPALIVE] = "inf"
    return env


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


class NixlRead(Handle):
    """One transfer (a read, or a write); opaque to callers, who pass it back to
    `poll` and `release`."""

    __slots__ = ("_xfer",)

    def __init__(self, peer: str, nbytes: int, op: str = "READ") -> None:
        super().__init__(peer, nbytes, op)
        self._xfer: Any = None  # the NIXL handle while it is ours to release


class _Peer(Peer[NixlRead]):
    __slots__ = ("prepped",)

    def __init__(self, info: PeerInfo) -> None:
        super().__init__(info)
        self.prepped: Any = None


class NixlTransport(Ledger[NixlRead, _Peer]):
    """`DataTransport` over one NIXL agent with one registered DRAM region.

    Nothing NIXL raises escapes `read`, `poll`, `release` or `progress`: a
    failure becomes a FAILED status with a `FailureKind`, and segments outside
    either region fail as INVALID before any memory is touched. Local misuse
    (no region registered, transport closed) raises `TransportError`.

    Counters, transfer lives and peer retirement are the `Ledger`'s (ledger.py):
    every read ends exactly once, so
    ``reads_started == reads_done + sum(reads_failed.values()) + reads_cancelled``
    once `in_flight` is 0. A read released while PENDING counts in
    `reads_abandoned` at once and in `reads_cancelled` when it has ended.
    Writes keep the same books under `writes_*` (and `bytes_written`);
    `reads_prepped` counts the transfers made from prepared descriptors.
    """

    _kind = KIND
    _handle_type = NixlRead

    def __init__(
        self,
        name: str,
        *,
        backends: Sequence[str] = ("UCX",),
        progress_thread: bool = False,
        num_threads: int = 0,
        ucx_env: Mapping[str, str] | None = None,
        prepared_block_size: int = 0,
        keepalive: bool = False,
    ) -> None:
        """`ucx_env` (e.g. ``{"UCX_TLS": "tcp"}``) is applied while the agent is
        created only. `prepared_block_size` > 0 turns on prepared descriptor lists.
        `keepalive` leaves UCX's endpoint keepalive on (see "Keepalive" above)."""
        super().__init__(name, threading.Lock())
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
            with _environ(agent_env(ucx_env or {}, keepalive=keepalive)):
                self._agent: Any = _create_agent(nixl_api, name, config)
        except Exception as e:
            raise TransportError(f"cannot create NIXL agent {name!r}: {e}") from e
        missing = [b for b in backends if b not in self._agent.backends]
        if missing or not self._agent.backends:
            raise TransportError(f"NIXL backends not available: {missing or list(backends)}")
        self._self_progressing = progress_thread
        tls = (ucx_env or {}).get("UCX_TLS", os.environ.get("UCX_TLS", ""))
        self._may_copy_in_call = may_attach(tls)
        self._block = prepared_block_size
        self._reg_descs: Any = None
        self._local_prepped: Any = None
        self._unreleased: list[Any] = []  # NIXL handles that refused to be released
        self.reads_prepped = 0

    @property
    def may_copy_in_call(self) -> bool:
        """UCX may pick cross-memory attach (or shared memory) for a peer on this
        host, and a READ over it copies inside the read call."""
        return self._may_copy_in_call

    @property
    def self_progressing(self) -> bool:
        """NIXL's progress thread moves reads from us; `progress` only collects notices."""
        return self._self_progressing

    @property
    def unreleased(self) -> int:
        """NIXL transfers whose release failed; retried by `progress` and `close`."""
        return len(self._unreleased)

    # ----------------------------------------------------------------- reads

    def poll(self, handle: ReadHandle) -> ReadStatus:
        """DONE or FAILED only on the backend's word that the read has ended."""
        handle = self._ours(handle)
        with self._lock:
            self._check(handle)
            return handle.status

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
            # Destroying the agent below ends them: no worker is left to write.
            self._end_all("transport closed")
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

    # ------------------------------------------------------ the Ledger's hooks

    def _register(self, address: int, size: int) -> None:
        try:
            self._reg_descs = self._agent.register_memory([(address, size, 0, "")], "DRAM")
            if self._block:
                self._local_prepped = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT", self._blocks(address, size), "DRAM"
                )
        except Exception as e:
            raise TransportError(f"cannot register region: {e}") from e

    def _metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    def _load(self, info: PeerInfo, known: _Peer | None) -> str:
        self._make_way(info.agent_name, known)
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

    def _unload(self, name: str, peer: _Peer | None = None) -> _Peer | None:
        """Drop a peer with no reads in flight, and its agent."""
        peer = super()._unload(name, peer)
        if peer is not None and peer.prepped is not None:
            self._quietly(self._agent.release_dlist_handle, peer.prepped)
        self._forget_agent(name)
        return peer

    def _handle(self, op: str, peer: str, segments: Sequence[Segment]) -> NixlRead:
        return NixlRead(peer, sum(s.length for s in segments), op)

    def _launch(
        self, handle: NixlRead, p: _Peer, segments: Sequence[Segment], notify: bytes
    ) -> None:
        assert self._region is not None
        merged = merge_segments(segments)
        try:
            handle._xfer = self._create(p, merged, self._region[0], notify, handle.op)
            state = self._agent.transfer(handle._xfer)
        except Exception as e:
            self._finish(handle, *self._failure(e))
            return
        p.reads.add(handle)
        self._settle(handle, state)

    def _let_go(self, handle: NixlRead) -> None:
        self._release_xfer(handle)

    def _send_note(self, peer: _Peer, message: bytes) -> bool:
        try:
            self._agent.send_notif(peer.info.agent_name, message)
        except Exception as e:
            log.warning("NIXL notification to %s failed: %s", peer.info.agent_name, e)
            return False
        return True

    # ------------------------------------------------------------------ NIXL

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
            self._done(handle)
        elif state != "PROC":
            self._finish(handle, FailureKind.BACKEND, f"transfer state {state}")

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
