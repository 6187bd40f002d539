"""What the workers of `ecshare proxy --workers N` share through their supervisor:
the registered members, and the encodes in flight.

Each worker holds one end of a Unix socket pair whose other end the supervisor keeps
(`ecshare.apps.proxy.workers`); nothing else can reach it: it has no address, and the
worker inherits its end from the supervisor only. Frames are a 4-byte length and one
msgpack message (`ToSupervisor`, `ToWorker`), typed here once.

The supervisor's side is `Coordinator`, a passive core (messages in, messages out):

* **Members.** It owns the set of registered members (`POST/DELETE /v1/members` on any
  worker is relayed to it as a `Change`). Every change is sent as the whole set, in
  order, to every worker (`Members`), before the worker that relayed it hears `Changed`;
  a worker that starts (or restarts) gets the current set before anything else. So every
  worker applies the same sets in the same order, and answers a registration only once
  it applied it. Static members (the command line) and DNS discovery are every
  worker's own: the same flags and the same names.
* **Flights.** A worker about to encode a content no request of its own is encoding
  asks to lead its flight (`Claim`); the first to ask leads (`Claimed(lead=True)`),
  the others wait for what it found (`Landed`), which it reports with `Land`. A flight
  whose leader ends (its channel closes) lands with nothing, and each waiter falls back
  as for a failed encode.

Bad frames from a worker (oversized, not decoding) are counted and end that channel;
the worker then ends and is replaced.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable
from typing import Annotated, Final, Literal

import msgspec

from ecshare.counts import Counts
from ecshare.protocol import TransferParam

MAX_TO_SUPERVISOR_BYTES: Final = 1 << 20
MAX_TO_WORKER_BYTES: Final = 32 << 20
MAX_KEY_CHARS: Final = 256
MAX_URL_CHARS: Final = 2048
_LENGTH = struct.Struct("!I")

Role = Literal["encoder", "prefill_decode"]
Key = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_KEY_CHARS)]
Url = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_URL_CHARS)]


class _Frame(msgspec.Struct, frozen=True, tag_field="t", forbid_unknown_fields=True):
    pass


class Change(_Frame, frozen=True, tag="change"):
    """Register (`join`) or unregister a member, relayed by the worker that was asked."""

    id: int
    join: bool
    role: Role
    url: Url


class Claim(_Frame, frozen=True, tag="claim"):
    """Lead the flight of `key`, unless another worker does."""

    key: Key


class Land(_Frame, frozen=True, tag="land"):
    """The flight of `key` that this worker leads is over: what it found, or nothing."""

    key: Key
    mm_hash: str | None = None
    param: TransferParam | None = None


class Members(_Frame, frozen=True, tag="members"):
    """The registered members now, as of change number `version`."""

    version: int
    registered: list[tuple[Role, Url]]


class Changed(_Frame, frozen=True, tag="changed"):
    """The answer to `Change` `id`: whether the registered set changed (the `Members`
    saying so came just before)."""

    id: int
    changed: bool


class Claimed(_Frame, frozen=True, tag="claimed"):
    key: Key
    lead: bool


class Landed(_Frame, frozen=True, tag="landed"):
    """Another worker's flight of `key` is over: what it found, or nothing."""

    key: Key
    mm_hash: str | None = None
    param: TransferParam | None = None


ToSupervisor = Change | Claim | Land
ToWorker = Members | Changed | Claimed | Landed

_encoder = msgspec.msgpack.Encoder()
_to_supervisor = msgspec.msgpack.Decoder(ToSupervisor)
_to_worker = msgspec.msgpack.Decoder(ToWorker)


class FrameError(ValueError):
    """A frame that is oversized or does not decode."""


def frame(message: ToSupervisor | ToWorker) -> bytes:
    body = _encoder.encode(message)
    return _LENGTH.pack(len(body)) + body


def split_frames(buffer: bytearray, limit: int) -> Iterable[bytes]:
    """Take every whole frame's body off the front of `buffer`; FrameError past `limit`."""
    while len(buffer) >= _LENGTH.size:
        (size,) = _LENGTH.unpack_from(buffer)
        if size > limit:
            raise FrameError(f"a frame of {size} bytes, over the limit of {limit}")
        if len(buffer) < _LENGTH.size + size:
            return
        body = bytes(buffer[_LENGTH.size : _LENGTH.size + size])
        del buffer[: _LENGTH.size + size]
        yield body


def decode_to_supervisor(body: bytes) -> ToSupervisor:
    try:
        return _to_supervisor.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(str(exc)) from None


def decode_to_worker(body: bytes) -> ToWorker:
    try:
        return _to_worker.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise FrameError(str(exc)) from None


def read_length(header: bytes) -> int:
    (size,) = _LENGTH.unpack(header)
    return int(size)


HEADER_BYTES: Final = _LENGTH.size

Out = tuple[int, ToWorker]  # (worker, message)


class Coordinator:
    """The supervisor's book of registered members and flights (see the module docstring)."""

    def __init__(self, *, max_per_role: int) -> None:
        self._max_per_role = max_per_role
        self._registered: dict[tuple[Role, str], None] = {}
        self._version = 0
        self._workers: set[int] = set()
        self._flights: dict[str, tuple[int, set[int]]] = {}  # key -> (leader, waiters)
        names = ("changes", "refused", "claims", "shared", "orphaned")
        self.stats = Counts(dict.fromkeys(names, 0))

    def attach(self, worker: int) -> list[Out]:
        """A worker's channel is open: the current set, before anything else."""
        self._workers.add(worker)
        return [(worker, self._members())]

    def detach(self, worker: int) -> list[Out]:
        """A worker's channel closed: the flights it led land with nothing."""
        self._workers.discard(worker)
        out: list[Out] = []
        for key, (leader, waiters) in list(self._flights.items()):
            waiters.discard(worker)
            if leader == worker:
                del self._flights[key]
                self.stats.add("orphaned")
                out += [(w, Landed(key)) for w in sorted(waiters)]
        return out

    def receive(self, worker: int, message: ToSupervisor) -> list[Out]:
        if isinstance(message, Change):
            return self._change(worker, message)
        if isinstance(message, Claim):
            self.stats.add("claims")
            flight = self._flights.get(message.key)
            if flight is None:
                self._flights[message.key] = (worker, set())
                return [(worker, Claimed(message.key, lead=True))]
            flight[1].add(worker)
            self.stats.add("shared")
            return [(worker, Claimed(message.key, lead=False))]
        flight = self._flights.get(message.key)
        if flight is None or flight[0] != worker:
            # Not its flight (it gave up before its claim was answered, and did not lead).
            if flight is not None:
                flight[1].discard(worker)
            return []
        del self._flights[message.key]
        landed = Landed(message.key, message.mm_hash, message.param)
        return [(w, landed) for w in sorted(flight[1])]

    def registered(self) -> list[tuple[Role, str]]:
        return list(self._registered)

    def _change(self, worker: int, change: Change) -> list[Out]:
        member = (change.role, change.url)
        changed = False
        if change.join and member not in self._registered:
            if sum(1 for role, _ in self._registered if role == change.role) >= self._max_per_role:
                self.stats.add("refused")
            else:
                self._registered[member] = None
                changed = True
        elif not change.join and member in self._registered:
            del self._registered[member]
            changed = True
        out: list[Out] = []
        if changed:
            self._version += 1
            self.stats.add("changes")
            members = self._members()
            out = [(w, members) for w in sorted(self._workers)]
        out.append((worker, Changed(change.id, changed)))
        return out

    def _members(self) -> Members:
        return Members(self._version, list(self._registered))
