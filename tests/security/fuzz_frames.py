"""Hostile control-plane frames: a fast, seeded generator for the fuzz tests.

Every frame starts from a valid encoded message of some type (`seed_messages`) and is
then broken in one of many ways: bit flips, byte overwrites, truncation, splices of
two messages, a wrong or unknown tag, a field of the wrong type, a length header that
claims gigabytes, deep nesting, or plain random bytes. The generator is a seeded
`random.Random`, so a failure names the seed and index that reproduce it.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any, Final

import msgspec

from ecshare import protocol as p

_ENCODE = msgspec.msgpack.Encoder().encode
_DECODE_RAW = msgspec.msgpack.Decoder().decode

# Values of every msgpack type, for "wrong field type" mutations.
_ODD_VALUES: Final[tuple[Any, ...]] = (
    None,
    True,
    False,
    -1,
    0,
    1 << 63,
    -(1 << 63),
    (1 << 64) - 1,
    1.5,
    float("nan"),
    float("inf"),
    "",
    "x" * 300,
    "\u202e\u0000\udcff".encode("utf-8", "surrogatepass").decode("utf-8", "replace"),
    b"",
    b"\x00" * 40,
    [],
    [1, 2, 3],
    [[[[]]]],
    {},
    {"t": "hello"},
    {"": None},
    msgspec.msgpack.Ext(1, b"\x00" * 8),
)


def seed_messages(session_id: str = "fuzz-session", grant_id: str = "g-fuzz") -> list[p.Message]:
    """One or more valid messages of every type in the protocol, both directions."""
    data_plane = p.DataPlaneInfo(
        kind="nixl", agent_name="fuzz-agent", agent_metadata=b"\x01" * 64, region_size=1 << 30
    )
    seeds: list[p.Message] = [
        p.Hello(
            versions=[1, 2],
            session_id=session_id,
            client_name="fuzzer",
            fingerprint="not-the-producers-fingerprint",
            capabilities=list(p.LOCAL_CAPABILITIES),
            data_plane=data_plane,
        ),
        p.Welcome(
            version=1,
            session_id=session_id,
            server_name="fuzz-producer",
            lease_ms=1000,
            heartbeat_ms=100,
            max_batch_items=16,
            data_plane=data_plane,
        ),
        p.FetchRequest(
            session_id=session_id,
            request_id="r-fuzz",
            items=[p.ItemRequest(f"h{i}", max_nbytes=i << 20) for i in range(4)],
        ),
        p.FetchReply(
            request_id="r-fuzz",
            items=[
                p.ItemReply(
                    mm_hash="h0",
                    status=p.ItemStatus.GRANTED,
                    grant_id=grant_id,
                    extents=[p.Extent(0, 4096), p.Extent(1 << 20, 100)],
                    nbytes=4196,
                    dtype="bfloat16",
                    shape=[2, 2098],
                    checksum=(1 << 64) - 1,
                    lease_ms=1000,
                ),
                p.ItemReply(mm_hash="h1", status=p.ItemStatus.MISSING, detail="gone"),
            ],
        ),
        p.Release(session_id=session_id, grant_ids=[grant_id, "g2"]),
        p.Released(released=[grant_id]),
        p.Renew(session_id=session_id, grant_ids=[grant_id]),
        p.Renewed(renewed=[grant_id], lease_ms=1000),
        p.Heartbeat(session_id=session_id),
        p.HeartbeatAck(),
        p.Bye(session_id=session_id),
        p.Error(code=p.ErrorCode.OVERLOADED, message="busy", request_id="r-fuzz"),
        p.PushCredit(session_id=session_id, credit_id="k1", extents=[p.Extent(0, 4096)]),
        p.Located(
            session_id=session_id,
            entries=[
                p.Location(
                    mm_hash="h0",
                    extents=[p.Extent(0, 4096), p.Extent(1 << 20, 100)],
                    nbytes=4196,
                    dtype="bfloat16",
                    shape=[2, 2098],
                    checksum=(1 << 64) - 1,
                )
            ],
        ),
    ]
    covered = {type(m) for m in seeds}
    # Types added to the protocol later are covered too, from their defaults where
    # they have them; a type this cannot build is named, not skipped.
    for kind in p.MESSAGE_TYPES:
        if kind not in covered:
            seeds.append(_minimal(kind))
    return seeds


def _minimal(kind: type) -> p.Message:
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(kind):
        if field.required:
            values[field.encode_name] = _guess(field.type)
    message = msgspec.convert({"t": kind.__struct_config__.tag, **values}, p.Message)  # type: ignore[attr-defined]
    assert isinstance(message, kind)
    return message


def _guess(annotation: Any) -> Any:
    info = msgspec.inspect.type_info(annotation)
    if isinstance(info, msgspec.inspect.StrType):
        return "s" * max(1, info.min_length or 1)
    if isinstance(info, msgspec.inspect.IntType):
        return max(1, info.ge or 0)
    if isinstance(info, msgspec.inspect.BoolType):
        return True
    if isinstance(info, msgspec.inspect.ListType | msgspec.inspect.DictType):
        return [] if isinstance(info, msgspec.inspect.ListType) else {}
    if isinstance(info, msgspec.inspect.EnumType):
        return next(iter(info.cls)).value
    raise AssertionError(f"no minimal value for {annotation!r}: extend fuzz_frames._guess")


class FrameFuzzer:
    """Yields hostile frames, reproducibly from `seed`."""

    def __init__(self, seed: int, seeds: list[p.Message] | None = None) -> None:
        self.rng = random.Random(seed)
        self.messages = seeds if seeds is not None else seed_messages()
        self.frames = [p.encode(m) for m in self.messages]
        self.bodies: list[dict[str, Any]] = [_DECODE_RAW(f) for f in self.frames]
        self.tags = [m.__struct_config__.tag for m in self.messages]  # type: ignore[attr-defined]
        self.mutations: list[tuple[str, Callable[[], bytes]]] = [
            ("bit_flips", self._bit_flips),
            ("byte_overwrite", self._byte_overwrite),
            ("truncate", self._truncate),
            ("splice", self._splice),
            ("wrong_tag", self._wrong_tag),
            ("wrong_field_type", self._wrong_field_type),
            ("missing_or_extra_field", self._missing_or_extra_field),
            ("huge_length", self._huge_length),
            ("deep_nesting", self._deep_nesting),
            ("random_bytes", self._random_bytes),
        ]

    def __iter__(self) -> Iterator[tuple[str, bytes]]:
        while True:
            name, mutate = self.mutations[self.rng.randrange(len(self.mutations))]
            yield name, mutate()

    # -- mutations ---------------------------------------------------------------------------

    def _frame(self) -> bytearray:
        return bytearray(self.frames[self.rng.randrange(len(self.frames))])

    def _bit_flips(self) -> bytes:
        frame = self._frame()
        for _ in range(self.rng.randint(1, 4)):
            frame[self.rng.randrange(len(frame))] ^= 1 << self.rng.randrange(8)
        return bytes(frame)

    def _byte_overwrite(self) -> bytes:
        frame = self._frame()
        for _ in range(self.rng.randint(1, 3)):
            # msgpack type markers (fixmap, array32, str32, never-used 0xc1...) do the most harm.
            frame[self.rng.randrange(len(frame))] = self.rng.choice(
                (0x00, 0x7F, 0x80, 0x8F, 0x90, 0xA0, 0xC0, 0xC1, 0xC4, 0xD9, 0xDC, 0xDD, 0xDF, 0xFF)
            )
        return bytes(frame)

    def _truncate(self) -> bytes:
        frame = self._frame()
        return bytes(frame[: self.rng.randrange(len(frame))])

    def _splice(self) -> bytes:
        a, b = self._frame(), self._frame()
        return bytes(a[: self.rng.randrange(len(a) + 1)] + b[self.rng.randrange(len(b)) :])

    def _body(self) -> dict[str, Any]:
        return dict(self.bodies[self.rng.randrange(len(self.bodies))])

    def _wrong_tag(self) -> bytes:
        body = self._body()
        body["t"] = self.rng.choice(
            [*self.tags, "", "HELLO", "hello\x00", "x" * 1000, 7, None, ["hello"]]
        )
        return _ENCODE(body)

    def _wrong_field_type(self) -> bytes:
        body = self._body()
        names = [k for k in body if k != "t"]
        for name in self.rng.sample(names, k=min(len(names), self.rng.randint(1, 2))):
            body[name] = self.rng.choice(_ODD_VALUES)
        return _ENCODE(body)

    def _missing_or_extra_field(self) -> bytes:
        body = self._body()
        if self.rng.random() < 0.5 and len(body) > 1:
            del body[self.rng.choice([k for k in body if k != "t"])]
        else:
            body[self.rng.choice(["extra", "session_id ", "\x00", "t2"])] = self.rng.choice(
                _ODD_VALUES
            )
        return _ENCODE(body)

    def _huge_length(self) -> bytes:
        # A container or string header that claims up to 4 GiB, followed by little.
        marker = self.rng.choice((0xDC, 0xDD, 0xDE, 0xDF, 0xDB, 0xC6, 0xDA, 0xC5))
        width = 2 if marker in (0xDC, 0xDE, 0xDA, 0xC5) else 4
        claimed = self.rng.choice((0xFFFF, 0xFFFFFFFF, 0x7FFFFFFF, 100_000))
        header = bytes([marker]) + claimed.to_bytes(4, "big")[-width:]
        junk = header + self.rng.randbytes(self.rng.randrange(64))
        if self.rng.random() < 0.5:
            return junk
        # The huge header where a field's value should be, inside a valid envelope.
        body = self._body()
        name = self.rng.choice([k for k in body if k != "t"] or ["items"])
        return _ENCODE({**body, name: msgspec.Raw(junk)})

    def _deep_nesting(self) -> bytes:
        depth = self.rng.choice((64, 1000, 10_000, 100_000))
        opener = self.rng.choice((b"\x91", b"\x81\xa1t"))
        body = self._body()
        inner = opener * depth + b"\xc0"
        return _ENCODE({**body, "items": msgspec.Raw(inner)}) if self.rng.random() < 0.5 else inner

    def _random_bytes(self) -> bytes:
        return self.rng.randbytes(self.rng.choice((0, 1, 2, 7, 64, 512, 4096)))


def classify(codec: p.Codec, frame: bytes, accepted: frozenset[type]) -> str:
    """'malformed', 'unexpected_kind' or 'valid': what a server receiving `frame` must do."""
    try:
        message = codec.decode(frame)
    except p.ProtocolError:
        return "malformed"
    return "valid" if type(message) in accepted else "unexpected_kind"
