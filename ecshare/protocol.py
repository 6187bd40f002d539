"""The wire: every control-plane message, typed once.

Each message is a tagged `msgspec.Struct` encoded as MessagePack. Decoding is
strict: a frame that is too large, truncated, of the wrong shape or of an
unknown kind raises `ProtocolError` and nothing else, so the serving loop has
one thing to count and drop.

Memory layout and data-plane metadata only travel in `Welcome`, which a
producer sends after the transport has authenticated the peer (CURVE), and
grants carry extents relative to the region, never absolute addresses. For a
push (docs/PUSH.md) the consumer's own data-plane metadata travels in its
`Hello`, and only to a producer whose key it has pinned and allows to push;
a `PushReply` carries the reserved extents, again relative to the region.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Mapping
from typing import Annotated, Any, Final, Union

import msgspec

from ecshare.config.schema import PushName
from ecshare.errors import ECShareError

# 2: heartbeats carry no sequence number, a PushReply no deadline (version 1 sent
# both and read neither); a peer that speaks only 1 is refused at the Hello.
PROTOCOL_VERSION: Final = 2
# Versions this build can speak, newest first. A handshake picks the highest
# version both sides list; a consumer refuses a Welcome naming any other.
SUPPORTED_VERSIONS: Final = (2,)

DEFAULT_MAX_FRAME_BYTES: Final = 1 << 20
MAX_BATCH_ITEMS: Final = 4096
MAX_EXTENTS_PER_ITEM: Final = 4096
MAX_NDIM: Final = 8

# Capabilities a peer may announce in the handshake; unknown ones are ignored
# so that newer peers can talk to older ones. A producer lists the checksum
# only when its entries carry one; a consumer that requires checksums refuses
# a producer without it. A consumer renews leases only where renewal was agreed.
CAP_CHECKSUM_XXH3_64: Final = "checksum.xxh3_64"
CAP_RENEW: Final = "lease.renew"
# Push: the producer may offer entries on this session and WRITE them into the
# consumer's region. A consumer lists it only to producers it allows to push,
# a producer only when its data plane can write; both must list it.
CAP_PUSH: Final = "push.write"
# Standing credit, with push: the consumer grants blocks ahead of time (`PushCredit`),
# and a push that fits them writes with no offer (`PushCredited`; docs/PUSH.md).
CAP_PUSH_CREDIT: Final = "push.credit"
# A FetchRequest may carry Releases (`FetchRequest.releases`), which the producer
# applies before it grants, with no answer of their own.
CAP_RELEASE_IN_REQUEST: Final = "release.in_request"
# Direct reads: the producer tells the consumer where each entry it commits lies
# (`Located`), and the consumer may READ it there with no request, keeping what it
# read only if its digest or tag checks out (ecshare/peer/direct.py;
# docs/SECURITY.md). A producer lists it only when its data plane serves reads
# without its own loop.
CAP_READ_DIRECT: Final = "read.direct"
LOCAL_CAPABILITIES: Final = (
    CAP_CHECKSUM_XXH3_64,
    CAP_RENEW,
    CAP_PUSH,
    CAP_PUSH_CREDIT,
    CAP_RELEASE_IN_REQUEST,
    CAP_READ_DIRECT,
)

# Most sessions listed one by one in a `StatusReply`; the counts cover them all.
MAX_STATUS_SESSIONS: Final = 4096


class ProtocolError(ECShareError, ValueError):
    """A frame that is not a valid message of this protocol."""


# Field constraints. Strings that name things are short; hashes are printable.
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
MMHash = Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
Token = Annotated[str, msgspec.Meta(min_length=1, max_length=128)]
Text = Annotated[str, msgspec.Meta(max_length=4096)]
NonNeg = Annotated[int, msgspec.Meta(ge=0)]
Size = Annotated[int, msgspec.Meta(ge=0, le=1 << 48)]
Millis = Annotated[int, msgspec.Meta(ge=0, le=24 * 3600 * 1000)]
Dim = Annotated[int, msgspec.Meta(ge=0, le=1 << 40)]


class ItemStatus(enum.Enum):
    """What a producer answers for one requested item."""

    GRANTED = "granted"
    NOT_READY = "not_ready"  # still being written: retry after a short wait
    MISSING = "missing"  # not held here (evicted or never produced)
    INCOMPATIBLE = "incompatible"  # held, but the consumer cannot use it
    OVERLOADED = "overloaded"  # too many grants outstanding: retry later
    TOO_LARGE = "too_large"  # larger than the consumer said it can take

    @property
    def retryable(self) -> bool:
        return self in (ItemStatus.NOT_READY, ItemStatus.OVERLOADED)


class ErrorCode(enum.Enum):
    BAD_MESSAGE = "bad_message"
    VERSION_MISMATCH = "version_mismatch"
    FINGERPRINT_MISMATCH = "fingerprint_mismatch"
    NO_SESSION = "no_session"
    TOO_MANY_SESSIONS = "too_many_sessions"
    BATCH_TOO_LARGE = "batch_too_large"
    OVERLOADED = "overloaded"
    SHUTTING_DOWN = "shutting_down"
    INTERNAL = "internal"
    FORBIDDEN = "forbidden"  # authenticated, but this key may not do that


class Extent(msgspec.Struct, frozen=True, array_like=True):
    """A contiguous byte range of a region: one data-plane descriptor."""

    offset: Size
    length: Size


class DataPlaneInfo(msgspec.Struct, frozen=True, kw_only=True):
    """What a peer needs to read from (or notify) this side's data plane."""

    kind: Annotated[str, msgspec.Meta(min_length=1, max_length=32)]
    agent_name: Name
    agent_metadata: bytes = b""
    region_address: Size = 0
    region_size: Size = 0
    # Where this side runs: its host's boot ID and PID namespace, and its process ID
    # there. A peer with the same `host` reads this side's tag words straight from
    # its memory (ecshare/peer/peek.py). Empty and 0: not told.
    host: Annotated[str, msgspec.Meta(max_length=128)] = ""
    pid: Annotated[int, msgspec.Meta(ge=0, le=(1 << 31) - 1)] = 0


class _Message(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag_field="t"):
    pass


class Hello(_Message, frozen=True, kw_only=True, tag="hello"):
    """Consumer -> producer: open a session.

    With `CAP_PUSH` listed, `push_name` is the name producers push to and
    `data_plane` is complete (metadata and region), so the producer can write.
    """

    versions: Annotated[
        list[Annotated[int, msgspec.Meta(ge=1, le=1 << 16)]],
        msgspec.Meta(min_length=1, max_length=16),
    ]
    session_id: Token
    client_name: Name
    fingerprint: Token
    capabilities: Annotated[list[Token], msgspec.Meta(max_length=64)] = []
    data_plane: DataPlaneInfo | None = None
    push_name: Annotated[str, msgspec.Meta(max_length=256)] = ""


class LaneOffer(msgspec.Struct, frozen=True, array_like=True):
    """The session's fetch lane (ecshare/control/lane.py): a TCP port on the host the
    consumer reached this producer on, the SHA-256 of the certificate its TLS server
    presents, and the key that proves the session on it. Only ever inside a
    `Welcome`, which CURVE encrypts. An offer without a certificate (a producer of
    an earlier release) is declined, and the session stays on ZMQ."""

    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    key: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)]
    cert_sha256: Annotated[bytes, msgspec.Meta(min_length=32, max_length=32)] | None = None


class Welcome(_Message, frozen=True, kw_only=True, tag="welcome"):
    """Producer -> consumer: session accepted; region registration, once.

    `version` is the one the producer picked from the Hello's list: a consumer
    refuses a Welcome naming a version it did not offer. `server_name` is the
    producer's name, which the consumer's logs and failures give beside its address.
    `lane`, when offered, carries FetchRequest/FetchReply and Release/Released of
    this session past ZMQ's I/O threads; a consumer that ignores it (or loses it)
    goes on over ZMQ.
    """

    version: Annotated[int, msgspec.Meta(ge=1)]
    session_id: Token
    server_name: Name
    capabilities: Annotated[list[Token], msgspec.Meta(max_length=64)] = []
    lease_ms: Millis
    heartbeat_ms: Millis
    max_batch_items: Annotated[int, msgspec.Meta(ge=1, le=MAX_BATCH_ITEMS)]
    data_plane: DataPlaneInfo
    lane: LaneOffer | None = None


class ItemRequest(msgspec.Struct, frozen=True, array_like=True):
    mm_hash: MMHash
    # The largest payload the consumer accepts for this item (0: no limit).
    max_nbytes: Size = 0


class FetchRequest(_Message, frozen=True, kw_only=True, tag="fetch"):
    """Consumer -> producer: grant these items. `request_id` is per attempt.

    With `CAP_RELEASE_IN_REQUEST` agreed, `releases` names grants whose reads have
    ended, as a `Release` would, released before the items are granted and not
    answered; a repeated request releases nothing twice (grant ids are never reused).
    """

    session_id: Token
    request_id: Token
    items: Annotated[list[ItemRequest], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]
    releases: Annotated[list[Token], msgspec.Meta(max_length=MAX_BATCH_ITEMS)] = []


class ItemReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    mm_hash: MMHash
    status: ItemStatus
    grant_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    extents: Annotated[list[Extent], msgspec.Meta(max_length=MAX_EXTENTS_PER_ITEM)] = []
    nbytes: Size = 0
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_NDIM)] = []
    checksum: Annotated[int, msgspec.Meta(ge=0)] | None = None  # a 64-bit digest
    lease_ms: Millis = 0
    retry_after_ms: Millis = 0
    detail: Text = ""


class FetchReply(_Message, frozen=True, kw_only=True, tag="fetch_reply"):
    request_id: Token
    items: Annotated[list[ItemReply], msgspec.Meta(max_length=MAX_BATCH_ITEMS)]


class Location(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Where one READY entry lies in the producer's region, and how to know that the
    bytes read there were still its: its digest, or its tag, or both.

    The tag is a word at `tag_offset` of the region that holds `tag` while the
    entry's blocks are its own, and never again once they were freed: a reader
    that reads it back after the bytes and finds `tag` read the entry's bytes.
    """

    mm_hash: MMHash
    extents: Annotated[list[Extent], msgspec.Meta(min_length=1, max_length=MAX_EXTENTS_PER_ITEM)]
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 48)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_NDIM)] = []
    checksum: Annotated[int, msgspec.Meta(ge=0)] | None = None  # xxh3-64 of the bytes
    tag: Annotated[int, msgspec.Meta(ge=0, le=(1 << 63) - 1)] = 0  # 0: none
    tag_offset: Size = 0


class Located(_Message, frozen=True, kw_only=True, tag="located"):
    """Producer -> consumer, unasked, with `CAP_READ_DIRECT` agreed: entries just
    committed and where they lie. Nothing holds them there: a consumer that reads
    one directly keeps the bytes only if their digest or tag checks out, and asks
    for a grant otherwise. Not answered."""

    session_id: Token
    entries: Annotated[list[Location], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class Release(_Message, frozen=True, kw_only=True, tag="release"):
    """Consumer -> producer: the reads of these grants have ended (or never started).

    It ends only grants of `session_id` made by the producer process that answers it:
    a grant id names its producer process (a random epoch in the id, so a restarted
    producer reuses none), and a consumer sends a Release only on the session the
    grant was made on. The id stays an opaque token on the wire (no new version).
    """

    session_id: Token
    grant_ids: Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class Released(_Message, frozen=True, kw_only=True, tag="released"):
    """Producer -> consumer: the answer to a `Release`, naming the grants it ended
    (counted by the consumer as `releases_confirmed`); one already ended, or of
    another producer process, is not named."""

    released: Annotated[list[Token], msgspec.Meta(max_length=MAX_BATCH_ITEMS)]


class Renew(_Message, frozen=True, kw_only=True, tag="renew"):
    """Consumer -> producer: still reading these grants; extend their leases.

    The producer answers `Renewed` with the grants it extended, each to
    `lease_ms` from when it handled the Renew.
    """

    session_id: Token
    grant_ids: Annotated[list[Token], msgspec.Meta(min_length=1, max_length=MAX_BATCH_ITEMS)]


class Renewed(_Message, frozen=True, kw_only=True, tag="renewed"):
    renewed: Annotated[list[Token], msgspec.Meta(max_length=MAX_BATCH_ITEMS)]
    lease_ms: Millis


class Heartbeat(_Message, frozen=True, kw_only=True, tag="ping"):
    """Consumer -> producer: this session is alive; answered with a `HeartbeatAck`,
    whose arrival (not its content) proves the producer is."""

    session_id: Token


class HeartbeatAck(_Message, frozen=True, kw_only=True, tag="pong"):
    pass


class Bye(_Message, frozen=True, kw_only=True, tag="bye"):
    """Consumer -> producer: the session ends.

    Grants it did not release may still be read, so they stay pinned until
    their leases run out.
    """

    session_id: Token


class PushStatus(enum.Enum):
    """What a consumer answers to one push offer."""

    ACCEPTED = "accepted"  # blocks reserved: write them, then say PushDone
    PRESENT = "present"  # already held here, READY: nothing to write
    BUSY = "busy"  # being fetched or pushed already
    FULL = "full"  # no room, even after eviction
    FORBIDDEN = "forbidden"  # push is off here, or this producer may not push
    INVALID = "invalid"  # an offer this consumer cannot take (size, meta, no checksum)


class PushOffer(_Message, frozen=True, kw_only=True, tag="push_offer"):
    """Producer -> consumer: I hold this entry READY; reserve room and I will write it.

    `push_id` names the push on this session; an offer repeated with the same id is
    answered with the same reply and reserves nothing twice.
    """

    session_id: Token
    push_id: Token
    mm_hash: MMHash
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 48)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_NDIM)] = []
    checksum: Annotated[int, msgspec.Meta(ge=0)] | None = None


class PushReply(_Message, frozen=True, kw_only=True, tag="push_reply"):
    """Consumer -> producer: the answer to an offer; `extents` only when ACCEPTED.

    A refusal's `detail` says why, and ends up in the producer's `PushOutcome`. The
    consumer's own deadline for the data is its business, not the producer's: a
    write may land after it, and the reservation is held until the producer's
    PushDone or the write's notification says it has ended.
    """

    session_id: Token
    push_id: Token
    status: PushStatus
    extents: Annotated[list[Extent], msgspec.Meta(max_length=MAX_EXTENTS_PER_ITEM)] = []
    detail: Text = ""


class PushDone(_Message, frozen=True, kw_only=True, tag="push_done"):
    """Producer -> consumer: the write of `push_id` has ended (its data plane said so)
    or was never posted; the reserved blocks are the consumer's again.

    `written` is True only when the whole write completed; if not, `detail` says
    why, and the consumer logs it.
    """

    session_id: Token
    push_id: Token
    written: bool
    detail: Text = ""


class PushCredit(_Message, frozen=True, kw_only=True, tag="push_credit"):
    """Consumer -> producer, on a session that agreed to push: blocks reserved ahead
    of time, so that a push whose item fits needs no offer. The producer may write
    one item into the first bytes of `extents`, once, telling `PushCredited` first;
    the credit ends, like a reservation, with the write's notification or a
    `PushDone` whose `push_id` is `credit_id` (written=False: returned unused).

    It is bound to its session: a producer process that did not open `session_id`
    (a restarted one) answers it `PushDone(written=False)` and writes nothing.
    """

    session_id: Token
    credit_id: Token
    extents: Annotated[list[Extent], msgspec.Meta(min_length=1, max_length=MAX_EXTENTS_PER_ITEM)]


class PushCredited(_Message, frozen=True, kw_only=True, tag="push_credited"):
    """Producer -> consumer: what it writes into credit `credit_id` (sent before the
    write), as a `PushOffer` would have said it; the consumer checks it as an offer
    and commits the credit's first `nbytes` under `mm_hash` when the write ends."""

    session_id: Token
    credit_id: Token
    mm_hash: MMHash
    nbytes: Annotated[int, msgspec.Meta(ge=1, le=1 << 48)]
    dtype: Annotated[str, msgspec.Meta(max_length=32)] = ""
    shape: Annotated[list[Dim], msgspec.Meta(max_length=MAX_NDIM)] = []
    checksum: Annotated[int, msgspec.Meta(ge=0)] | None = None


class PushCreditVoid(_Message, frozen=True, kw_only=True, tag="push_credit_void"):
    """Consumer -> producer, on a new session with the same producer process: credit
    `credit_id`, granted on this consumer's ended session `credit_session`, is void.
    Unless it is writing into it (its `PushDone` then follows the write), the producer
    drops it, never writes into it from now on, and answers `PushDone(session_id=
    credit_session, push_id=credit_id, written=False)`: so a credit whose grant or
    whose return a cut control connection lost still comes back."""

    session_id: Token
    credit_session: Token
    credit_id: Token


class Error(_Message, frozen=True, kw_only=True, tag="error"):
    code: ErrorCode
    message: Text
    request_id: Annotated[str, msgspec.Meta(max_length=128)] = ""


class StatusRequest(_Message, frozen=True, kw_only=True, tag="status"):
    """Admin -> producer: what do you hold and serve? Needs no session."""

    request_id: Token


class SessionStatus(msgspec.Struct, frozen=True, kw_only=True):
    """One consumer session, as a status reply shows it: never its key, only a digest."""

    key_fingerprint: Annotated[str, msgspec.Meta(max_length=64)]
    client_name: Name
    version: Annotated[int, msgspec.Meta(ge=1)]
    grants: NonNeg
    pinned_bytes: Size
    idle_ms: NonNeg


class StatusReply(_Message, frozen=True, kw_only=True, tag="status_reply"):
    """Producer -> admin: entries, region use, grants and sessions, at one moment."""

    request_id: Token
    server_name: Name
    protocol_version: Annotated[int, msgspec.Meta(ge=1)]
    fingerprint: Token
    uptime_ms: NonNeg
    entries: NonNeg
    # Entries per state name (allocated, ready, evicting).
    entries_by_state: Annotated[dict[Token, NonNeg], msgspec.Meta(max_length=16)]
    region_bytes: Size
    block_bytes: Size
    blocks_total: NonNeg
    blocks_used: NonNeg
    blocks_free: NonNeg
    used_bytes: Size  # bytes of whole blocks held by entries
    payload_bytes: Size  # bytes of the entries themselves
    free_bytes: Size
    # Blocks held because a read into them may still be in flight (never reused
    # until the data plane says it ended), and writes after free the debug
    # canary caught (store_canary only).
    quarantined_bytes: Size
    canary_violations: NonNeg
    grants_active: NonNeg
    pinned_entries: NonNeg
    pinned_bytes: Size
    sessions_total: NonNeg
    peers: NonNeg  # distinct authenticated keys with a session
    sessions: Annotated[list[SessionStatus], msgspec.Meta(max_length=MAX_STATUS_SESSIONS)] = []
    counters: Annotated[dict[Token, NonNeg], msgspec.Meta(max_length=256)] = {}


Message = Union[  # noqa: UP007 - msgspec needs a runtime Union of tagged structs
    Hello,
    Welcome,
    FetchRequest,
    FetchReply,
    Release,
    Released,
    Renew,
    Renewed,
    Heartbeat,
    HeartbeatAck,
    Bye,
    Error,
    StatusRequest,
    StatusReply,
    PushOffer,
    PushReply,
    PushDone,
    PushCredit,
    PushCredited,
    PushCreditVoid,
    Located,
]
MESSAGE_TYPES: Final = Message.__args__  # type: ignore[attr-defined]


class Codec:
    """Encodes and strictly decodes messages, refusing frames over a size limit."""

    def __init__(self, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES) -> None:
        if max_frame_bytes <= 0:
            raise ValueError(f"max_frame_bytes must be positive, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder: msgspec.msgpack.Decoder[Message] = msgspec.msgpack.Decoder(Message)

    def encode(self, message: Message) -> bytes:
        frame = self._encoder.encode(message)
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(
                f"{type(message).__name__} encodes to {len(frame)} bytes, "
                f"over the {self.max_frame_bytes}-byte frame limit"
            )
        return frame

    def decode(self, frame: bytes | bytearray | memoryview) -> Message:
        if len(frame) > self.max_frame_bytes:
            raise ProtocolError(
                f"frame of {len(frame)} bytes is over the {self.max_frame_bytes}-byte limit"
            )
        try:
            return self._decoder.decode(frame)
        except msgspec.DecodeError as exc:  # ValidationError is a DecodeError
            raise ProtocolError(f"malformed frame: {exc}") from None
        except (ValueError, TypeError, OverflowError, RecursionError) as exc:
            raise ProtocolError(f"malformed frame: {type(exc).__name__}: {exc}") from None


_default_codec = Codec()


def encode(message: Message) -> bytes:
    return _default_codec.encode(message)


def decode(frame: bytes | bytearray | memoryview) -> Message:
    return _default_codec.decode(frame)


def negotiate_version(offered: list[int]) -> int | None:
    """The highest version both sides speak, or None."""
    common = set(offered).intersection(SUPPORTED_VERSIONS)
    return max(common) if common else None


def negotiate_capabilities(offered: list[str]) -> list[str]:
    return [c for c in LOCAL_CAPABILITIES if c in offered]


class _FingerprintInput(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    model_revision: str
    encoder_config: Any
    dtype: str
    hidden_size: int
    protocol_version: int


def fingerprint(
    *,
    model_id: str,
    model_revision: str = "",
    encoder_config: Mapping[str, Any] | None = None,
    dtype: str,
    hidden_size: int,
    protocol_version: int = PROTOCOL_VERSION,
) -> str:
    """A compatibility fingerprint: equal only when every input is equal.

    Two instances exchange entries only when their fingerprints match, because
    an embedding from a different model, revision, encoder setting or dtype
    would be silently wrong. Mapping keys are sorted so that the fingerprint
    does not depend on insertion order.
    """
    payload = _FingerprintInput(
        model_id=model_id,
        model_revision=model_revision,
        encoder_config=dict(encoder_config or {}),
        dtype=dtype,
        hidden_size=hidden_size,
        protocol_version=protocol_version,
    )
    try:
        blob = msgspec.msgpack.encode(payload, order="sorted")
    except (TypeError, msgspec.EncodeError) as exc:
        raise ValueError(f"fingerprint input is not serialisable: {exc}") from None
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


# -- ec_transfer_params: the HTTP-side wire between the instances and the proxy ---------------
#
# An encoder answers each finished request with `ec_transfer_params`, a map of each item's
# mm_hash to its `TransferParam`; the proxy forwards that map to prefill/decode, whose
# connector fetches each item from it. A request to an encoder may instead carry a
# `PushRequest`. Both travel as JSON inside vLLM's request and answer bodies.

# Push names one encoder request may name (`PushRequest.push_to`, `TransferParam.pushed_to`).
MAX_PUSH_NAMES: Final = 8
PushNames = Annotated[tuple[PushName, ...], msgspec.Meta(max_length=MAX_PUSH_NAMES)]


class ParamsError(ProtocolError):
    """`ec_transfer_params` that are not valid: malformed, oversized or with unknown fields."""


class TransferParam(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, forbid_unknown_fields=True
):
    """One item's `ec_transfer_params`: where a consumer fetches it, and what it is.

    It names a producer endpoint and what the entry is, never a memory address or
    data-plane metadata; those are exchanged only after authentication. `modality` is
    the item's, as vLLM 0.34's own connectors publish it (params without it, vLLM 0.32's
    shape, are accepted). `metadata` holds the placeholder fields the model declares
    for the modality (ecshare.vllm.placeholders; empty where the item needs its media),
    `item_indices` the item's positions in the request's items, and `pushed_to` the push
    names its encoder started a push to (ecshare.vllm.pushes).
    """

    peer: Name
    fingerprint: Name
    nbytes: Size
    dtype: Name
    shape: Annotated[tuple[Dim, ...], msgspec.Meta(max_length=MAX_NDIM)]
    modality: Name | None = None
    # None where the producer published none (vLLM's connectors always publish a dict).
    metadata: Annotated[dict[Name, Any], msgspec.Meta(max_length=64)] | None = None
    item_indices: Annotated[tuple[NonNeg, ...], msgspec.Meta(max_length=MAX_BATCH_ITEMS)] = ()
    pushed_to: PushNames = ()


class PushRequest(msgspec.Struct, frozen=True, kw_only=True):
    """The `ec_transfer_params` of a request to an encoder: the push names to push its
    items to (other keys are ignored)."""

    push_to: PushNames = ()


# A request's or an answer's items: each mm_hash to its params.
ItemParams = Annotated[dict[MMHash, TransferParam], msgspec.Meta(max_length=MAX_BATCH_ITEMS)]


def decode_item(raw: object) -> TransferParam:
    """One item's params from a decoded JSON value; raises `ParamsError`."""
    try:
        return msgspec.convert(raw, TransferParam, strict=False)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ParamsError(f"malformed item params: {exc}") from None


def decode_items(raw: object) -> dict[str, TransferParam]:
    """The items of an answer's `ec_transfer_params`; raises `ParamsError`."""
    try:
        return msgspec.convert(raw, ItemParams, strict=False)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ParamsError(f"malformed ec_transfer_params: {exc}") from None


def decode_push_request(raw: object) -> PushRequest:
    """A request's push names; `{}` and params without `push_to` ask for none. Raises
    `ParamsError`."""
    if not isinstance(raw, Mapping):
        raise ParamsError(f"ec_transfer_params is not an object: {type(raw).__name__}")
    try:
        return msgspec.convert({"push_to": raw.get("push_to", ())}, PushRequest)
    except (msgspec.ValidationError, TypeError) as exc:
        raise ParamsError(f"malformed push_to: {exc}") from None
