"""The data-plane interface.

A transport knows regions, extents and peers, nothing about requests or
mm_hashes. The consumer side READs a peer's extents into its own region; the
producer side registers its region and drives progress, and for a push WRITEs
its own extents into a peer's region.

The lifetime rule every implementation keeps: a read's destination (a write's
source, and the peer's destination) may be touched until `poll` answers DONE
or FAILED, and `poll` answers so only on the backend's word that the transfer
has ended. Releasing a pending transfer, removing its peer or re-adding it
does not end it; only the backend (or `close`) does. The target of a write
holds no handle: the write's notification, delivered once after the data has
landed, is the one word its own backend gives it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ecshare.errors import ECShareError


class TransportError(ECShareError):
    """The transport could not be set up or used (bad config, missing library)."""


class ReadState(enum.Enum):
    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


class FailureKind(enum.Enum):
    """Why a read failed, in terms a consumer can act on."""

    PEER_DISCONNECTED = "peer_disconnected"  # the remote process is gone
    NOT_FOUND = "not_found"  # memory or peer not known (restart, deregistered)
    INVALID = "invalid"  # descriptors rejected: a bug or a hostile grant
    BACKEND = "backend"  # any other transport error


@dataclass(frozen=True)
class Segment:
    """One descriptor: `length` bytes from remote `remote_offset` to local `local_offset`.

    Offsets are relative to the start of each side's registered region.
    """

    local_offset: int
    remote_offset: int
    length: int


@dataclass(frozen=True)
class PeerInfo:
    """What one side publishes about its data plane (after authentication only)."""

    kind: str
    agent_name: str
    agent_metadata: bytes
    region_address: int
    region_size: int


@dataclass(frozen=True)
class ReadStatus:
    state: ReadState
    failure: FailureKind | None = None
    detail: str = ""


class ReadHandle(Protocol):
    """An in-flight read or write; opaque to callers."""


class DataTransport(Protocol):
    @property
    def kind(self) -> str: ...

    def register(self, address: int, size: int) -> None:
        """Register the local region; required before reads or `local_info`.

        Registering the same region again is a no-op; another region is an error.
        """

    def local_info(self) -> PeerInfo: ...

    def add_peer(self, info: PeerInfo) -> str:
        """Load a peer's data-plane info; returns its peer name. Re-adding replaces."""

    def remove_peer(self, name: str) -> None:
        """New reads from `name` fail at once; reads in flight stay PENDING until they end."""

    def read(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> ReadHandle:
        """Start reading `segments` from `peer`; never blocks on remote progress."""

    def poll(self, handle: ReadHandle) -> ReadStatus:
        """DONE or FAILED once the backend has ended the transfer; PENDING until then."""

    def release(self, handle: ReadHandle) -> None:
        """The caller is done with a handle. A PENDING read is abandoned: the
        transport keeps driving it, and `poll` still answers PENDING until it ends."""

    def progress(self) -> list[tuple[str, bytes]]:
        """Drive target-side progress; returns (peer name, message) notifications."""

    @property
    def self_progressing(self) -> bool:
        """Reads from us move without `progress` calls (the transport has its own
        event-driven progress); `progress` is then needed only for notifications."""

    @property
    def may_copy_in_call(self) -> bool:
        """A read of ours may end inside the read call (a copy on one host): worth
        making on a thread that waits for it anyway (`Consumer._lend`). Whether it
        does for a given peer, only its reads tell."""

    @property
    def in_flight(self) -> int:
        """Reads not yet ended by the backend, abandoned ones included."""

    def close(self) -> None:
        """End every read (the backend goes with it), forget peers, deregister."""


def pair_segments(
    local: Sequence[tuple[int, int]], remote: Sequence[tuple[int, int]]
) -> list[Segment]:
    """Pair two extent lists (offset, length) of equal total length into segments.

    Each segment is contiguous on both sides, so the count is at most
    len(local) + len(remote) - 1, and 1 when both sides are contiguous.
    """
    if len(local) == 1 and len(remote) == 1:  # the common case, without the loops
        (l_off, l_len), (r_off, r_len) = local[0], remote[0]
        if l_len < 0 or r_len < 0:
            raise ValueError("negative extent length")
        if l_len != r_len:
            raise ValueError("local and remote extents differ in total length")
        return [Segment(l_off, r_off, l_len)] if l_len else []
    # A negative length would shift every later segment outside its extent.
    if any(n < 0 for _, n in local) or any(n < 0 for _, n in remote):
        raise ValueError("negative extent length")
    if sum(n for _, n in local) != sum(n for _, n in remote):
        raise ValueError("local and remote extents differ in total length")
    segments: list[Segment] = []
    li = ri = 0
    l_used = r_used = 0
    while li < len(local) and ri < len(remote):
        l_off, l_len = local[li]
        r_off, r_len = remote[ri]
        n = min(l_len - l_used, r_len - r_used)
        if n > 0:
            segments.append(Segment(l_off + l_used, r_off + r_used, n))
        l_used += n
        r_used += n
        if l_used == l_len:
            li, l_used = li + 1, 0
        if r_used == r_len:
            ri, r_used = ri + 1, 0
    return segments


class WritingTransport(DataTransport, Protocol):
    """A transport that can also push: write our extents into a peer's region."""

    def write(self, peer: str, segments: Sequence[Segment], notify: bytes = b"") -> ReadHandle:
        """Start writing our `local_offset`s to `peer`'s `remote_offset`s; never blocks on
        remote progress. Polled and released like a read; `notify` reaches the peer once
        the data has landed."""

    def note(self, peer: str, message: bytes) -> bool:
        """Send `message` to `peer`'s `progress`, bound to no transfer; False where it could
        not be sent. Sent once a write is DONE, it says what the write's `notify` would,
        without holding the write's DONE until the peer has taken it."""


def writer_of(transport: DataTransport) -> WritingTransport | None:
    """`transport` if it can write (push), else None."""
    if callable(getattr(transport, "write", None)):
        return transport  # type: ignore[return-value]
    return None
