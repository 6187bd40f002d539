"""The decoder takes anything: hostile frames raise ProtocolError and nothing else.

A fast seeded mutation loop (fuzz_frames.py) covers the bulk of the frames; a
structure-aware hypothesis test builds messages field by field, with right and
wrong values, to reach the validation paths that random bytes rarely do.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import msgspec
import pytest
from fuzz_frames import FrameFuzzer, seed_messages
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecshare import protocol as p

pytestmark = pytest.mark.timeout(120)

DECODER_FRAMES = 120_000
# Mutations that can never yield a whole valid message.
NEVER_VALID = ("truncate", "huge_length")


def _decode(codec: p.Codec, frame: bytes) -> p.Message | None:
    """The message, or None for a ProtocolError; any other exception fails the test."""
    try:
        message = codec.decode(frame)
    except p.ProtocolError:
        return None
    assert isinstance(message, p.MESSAGE_TYPES)
    return message


def test_mutated_frames_raise_only_protocol_error() -> None:
    codec = p.Codec()
    outcomes: Counter[tuple[str, str]] = Counter()
    for index, (mutation, frame) in enumerate(FrameFuzzer(seed=20240601)):
        if index == DECODER_FRAMES:
            break
        try:
            message = _decode(codec, frame)
        except BaseException as exc:  # name the frame that broke it
            raise AssertionError(f"frame {index} ({mutation}) {frame[:200]!r}: {exc!r}") from exc
        if message is None:
            outcomes[(mutation, "rejected")] += 1
            continue
        outcomes[(mutation, "decoded")] += 1
        # Whatever the decoder accepts is a message this side could have sent:
        # it re-encodes within the limits and decodes to the same value.
        assert codec.decode(codec.encode(message)) == message, (index, mutation, frame)

    total = sum(outcomes.values())
    rejected = sum(n for (_, kind), n in outcomes.items() if kind == "rejected")
    print(f"decoder fuzz: {total} mutated frames, {rejected} rejected, {total - rejected} decoded")
    for (mutation, kind), n in sorted(outcomes.items()):
        print(f"  {mutation:24} {kind:9} {n}")
    assert total == DECODER_FRAMES
    for mutation in NEVER_VALID:
        assert outcomes[(mutation, "decoded")] == 0, mutation
        assert outcomes[(mutation, "rejected")] > 0, mutation
    # Every mutation ran, and most frames were broken.
    assert {m for m, _ in outcomes} == {name for name, _ in FrameFuzzer(seed=0).mutations}
    assert rejected > total * 0.8


def test_deep_nesting_and_huge_lengths_are_refused_without_allocating() -> None:
    codec = p.Codec(max_frame_bytes=1 << 20)
    for depth in (1000, 100_000, 500_000):
        assert _decode(codec, b"\x91" * depth + b"\xc0") is None
    # A 100k-item FetchRequest fits the frame limit, and is refused by the item bound.
    items = [[f"h{i}", 0] for i in range(100_000)]
    frame = msgspec.msgpack.encode(
        {"t": "fetch", "session_id": "s", "request_id": "r", "items": items}
    )
    assert len(frame) < 1 << 20
    with pytest.raises(p.ProtocolError, match="items"):
        codec.decode(frame)
    # Headers that claim 4 GiB of array, map, string or bytes, with nothing behind them.
    for marker in (b"\xdd", b"\xdf", b"\xdb", b"\xc6"):
        assert _decode(codec, marker + b"\xff\xff\xff\xff") is None
        assert (
            _decode(codec, b"\x82\xa1t\xa5hello\xa8versions" + marker + b"\xff\xff\xff\xff") is None
        )


# -- structure-aware ---------------------------------------------------------------------------

_SEEDS = seed_messages()
_BODIES: list[dict[str, Any]] = [msgspec.msgpack.decode(p.encode(m)) for m in _SEEDS]
_TAG_TO_TYPE = {m.__struct_config__.tag: type(m) for m in _SEEDS}  # type: ignore[attr-defined]

_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=300)
    | st.binary(max_size=64)
)
_values = st.recursive(
    _scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@st.composite
def _structured(draw: st.DrawFn) -> dict[str, Any]:
    """A seed message's fields, each kept, replaced by any value, or dropped; maybe extras."""
    body = dict(draw(st.sampled_from(_BODIES)))
    for name in [k for k in body if k != "t"]:
        action = draw(st.sampled_from(("keep", "keep", "replace", "drop")))
        if action == "replace":
            body[name] = draw(_values)
        elif action == "drop":
            del body[name]
    if draw(st.booleans()):
        body[draw(st.text(max_size=10))] = draw(_values)
    if draw(st.integers(0, 9)) == 0:
        body["t"] = draw(st.sampled_from([*_TAG_TO_TYPE, "", "status ", 0]))
    return body


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=_structured())
def test_structured_messages_decode_exactly_or_raise_protocol_error(body: dict[str, Any]) -> None:
    message = _decode(p.Codec(), msgspec.msgpack.encode(body))
    if message is None:
        return
    # Accepted: it is the tagged type, and every known field it was given came through as sent.
    assert type(message) is _TAG_TO_TYPE[body["t"]]
    sent = msgspec.msgpack.decode(msgspec.msgpack.encode(body))
    decoded = msgspec.msgpack.decode(p.encode(message))
    for name in message.__struct_fields__:
        if name in sent:
            assert decoded.get(name, sent[name]) == sent[name], name
