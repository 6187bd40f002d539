"""The wire: round trips, strict decoding, and the compatibility fingerprint."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ecshare import protocol as p

DP = p.DataPlaneInfo(
    kind="nixl",
    agent_name="prod-1",
    agent_metadata=b"\x00meta",
    region_address=0,
    region_size=1 << 30,
)

EXAMPLES: list[p.Message] = [
    p.Hello(
        versions=[2],
        session_id="s1",
        client_name="consumer-a",
        fingerprint="f" * 32,
        capabilities=list(p.LOCAL_CAPABILITIES),
        data_plane=p.DataPlaneInfo(kind="nixl", agent_name="cons-1"),
    ),
    p.Welcome(
        version=1,
        session_id="s1",
        server_name="producer-a",
        capabilities=[p.CAP_RENEW],
        lease_ms=30_000,
        heartbeat_ms=1000,
        max_batch_items=256,
        data_plane=DP,
    ),
    p.FetchRequest(
        session_id="s1",
        request_id="r-1",
        items=[p.ItemRequest("h1"), p.ItemRequest("h2", max_nbytes=1 << 20)],
    ),
    p.FetchReply(
        request_id="r-1",
        items=[
            p.ItemReply(
                mm_hash="h1",
                status=p.ItemStatus.GRANTED,
                grant_id="g1",
                extents=[p.Extent(0, 4096), p.Extent(65536, 100)],
                nbytes=4196,
                dtype="bfloat16",
                shape=[2, 2098],
                checksum=(1 << 64) - 1,
                lease_ms=30_000,
            ),
            p.ItemReply(mm_hash="h2", status=p.ItemStatus.NOT_READY, retry_after_ms=20),
        ],
    ),
    p.Release(session_id="s1", grant_ids=["g1"]),
    p.Released(released=["g1"]),
    p.Renew(session_id="s1", grant_ids=["g1", "g2"]),
    p.Renewed(renewed=["g1"], lease_ms=30_000),
    p.Heartbeat(session_id="s1"),
    p.HeartbeatAck(),
    p.Bye(session_id="s1"),
    p.Error(code=p.ErrorCode.FINGERPRINT_MISMATCH, message="model differs", request_id="r-1"),
    p.StatusRequest(request_id="st-1"),
    p.StatusReply(
        request_id="st-1",
        server_name="producer-a",
        protocol_version=1,
        fingerprint="f" * 32,
        uptime_ms=12_345,
        entries=3,
        entries_by_state={"allocated": 1, "ready": 2, "evicting": 0},
        region_bytes=1 << 30,
        block_bytes=65536,
        blocks_total=16384,
        blocks_used=70,
        blocks_free=16314,
        used_bytes=70 * 65536,
        payload_bytes=4_500_000,
        free_bytes=16314 * 65536,
        quarantined_bytes=0,
        canary_violations=0,
        grants_active=1,
        pinned_entries=1,
        pinned_bytes=4_194_304,
        sessions_total=1,
        peers=1,
        sessions=[
            p.SessionStatus(
                key_fingerprint="sha256:0123456789abcdef",
                client_name="consumer-a",
                version=1,
                grants=1,
                pinned_bytes=4_194_304,
                idle_ms=20,
            )
        ],
        counters={"granted": 7},
    ),
    p.PushOffer(
        session_id="s1",
        push_id="p1",
        mm_hash="h1",
        nbytes=4_505_600,
        dtype="bfloat16",
        shape=[880, 2560],
        checksum=12345,
    ),
    p.PushReply(
        session_id="s1",
        push_id="p1",
        status=p.PushStatus.ACCEPTED,
        extents=[p.Extent(0, 4_194_304), p.Extent(8_388_608, 311_296)],
    ),
    p.PushReply(session_id="s1", push_id="p2", status=p.PushStatus.FULL, detail="no room"),
    p.PushDone(session_id="s1", push_id="p1", written=True),
    p.PushCredit(session_id="s1", credit_id="k1.ab", extents=[p.Extent(0, 8_388_608)]),
    p.PushCreditVoid(session_id="s2", credit_session="s1", credit_id="k1.ab"),
    p.PushCredited(
        session_id="s1",
        credit_id="k1.ab",
        mm_hash="h1",
        nbytes=4_505_600,
        dtype="bfloat16",
        shape=[880, 2560],
        checksum=12345,
    ),
    p.Located(
        session_id="s1",
        entries=[
            p.Location(
                mm_hash="h1",
                extents=[p.Extent(0, 4096), p.Extent(65536, 904)],
                nbytes=5000,
                dtype="bfloat16",
                shape=[2500],
                checksum=2**64 - 1,
            )
        ],
    ),
]


def test_every_message_type_has_an_example() -> None:
    assert {type(m) for m in EXAMPLES} == set(p.MESSAGE_TYPES)


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(message: p.Message) -> None:
    assert p.decode(p.encode(message)) == message


def test_grant_is_small_and_carries_no_addresses() -> None:
    # A grant names extents relative to the region; the region's registration
    # travels once per session in Welcome, not in every grant.
    reply = EXAMPLES[3]
    assert isinstance(reply, p.FetchReply)
    one = p.FetchReply(request_id="r-1", items=reply.items[:1])
    assert len(p.encode(one)) < 256
    assert "address" not in " ".join(p.ItemReply.__struct_fields__)


def test_oversized_frame_is_refused_before_decoding() -> None:
    codec = p.Codec(max_frame_bytes=64)
    frame = p.encode(EXAMPLES[0])
    assert len(frame) > 64
    with pytest.raises(p.ProtocolError, match="over the 64-byte limit"):
        codec.decode(frame)
    with pytest.raises(p.ProtocolError, match="frame limit"):
        codec.encode(EXAMPLES[0])


@pytest.mark.parametrize("message", EXAMPLES, ids=lambda m: type(m).__name__)
def test_truncated_frames_raise_protocol_error(message: p.Message) -> None:
    frame = p.encode(message)
    for cut in range(len(frame)):
        with pytest.raises(p.ProtocolError):
            p.decode(frame[:cut])


def test_unknown_tag_raises_protocol_error() -> None:
    frame = msgspec.msgpack.encode({"t": "launch_missiles", "session_id": "s"})
    with pytest.raises(p.ProtocolError, match="launch_missiles"):
        p.decode(frame)


def test_wrong_type_raises_protocol_error() -> None:
    frame = msgspec.msgpack.encode({"t": "renewed", "renewed": [], "lease_ms": "seven"})
    with pytest.raises(p.ProtocolError, match="lease_ms"):
        p.decode(frame)


def test_out_of_bounds_values_raise_protocol_error() -> None:
    frame = msgspec.msgpack.encode({"t": "renewed", "renewed": [], "lease_ms": -1})
    with pytest.raises(p.ProtocolError):
        p.decode(frame)
    too_many = [["h", 0]] * (p.MAX_BATCH_ITEMS + 1)
    frame = msgspec.msgpack.encode(
        {"t": "fetch", "session_id": "s", "request_id": "r", "items": too_many}
    )
    with pytest.raises(p.ProtocolError):
        p.Codec(max_frame_bytes=1 << 22).decode(frame)


msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=(1 << 64) - 1)
    | st.floats(allow_nan=True)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=12), children, max_size=6)
    ),
    # Wide and shallow: a wrong shape needs a few values of the wrong kind, not deep
    # trees, which hypothesis takes long to draw (max_leaves=25 cost 50 s a run).
    max_leaves=8,
)
# Keys a message really has, so that a drawn body often hits a known field with a
# value of the wrong kind, not only fields nobody reads.
field_names = st.sampled_from(
    sorted({f for m in p.MESSAGE_TYPES for f in m.__struct_fields__})
) | st.text(max_size=16)
tags = st.sampled_from(
    [m.__struct_config__.tag for m in p.MESSAGE_TYPES] + ["", "nope"]  # type: ignore[attr-defined]
)


def _decodes_or_protocol_error(frame: bytes) -> None:
    try:
        msg = p.decode(frame)
    except p.ProtocolError:
        return
    assert isinstance(msg, p.MESSAGE_TYPES)


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=512))
def test_random_bytes_never_raise_anything_but_protocol_error(frame: bytes) -> None:
    _decodes_or_protocol_error(frame)


# 500 bodies whose keys are mostly real field names reach more of the decoder's
# checks than the 1,500 of random keys this drew before (the decoder skips unknown
# fields, so those bodies failed on missing fields whatever their values), at a
# quarter of the drawing time.
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tag=tags, body=st.dictionaries(field_names, msgpack_values, max_size=8))
def test_wrongly_shaped_messages_raise_protocol_error(tag: str, body: dict[str, object]) -> None:
    body["t"] = tag
    _decodes_or_protocol_error(msgspec.msgpack.encode(body))


@settings(max_examples=1500, deadline=None)
@given(
    index=st.integers(min_value=0, max_value=len(EXAMPLES) - 1),
    flips=st.lists(st.tuples(st.integers(min_value=0), st.integers(0, 255)), max_size=4),
)
def test_mutated_frames_raise_protocol_error(index: int, flips: list[tuple[int, int]]) -> None:
    frame = bytearray(p.encode(EXAMPLES[index]))
    for pos, value in flips:
        frame[pos % len(frame)] = value
    _decodes_or_protocol_error(bytes(frame))


def test_version_negotiation_picks_highest_common() -> None:
    newest = max(p.SUPPORTED_VERSIONS)
    assert p.negotiate_version([1, *p.SUPPORTED_VERSIONS, 99]) == newest
    assert p.negotiate_version([99]) is None
    assert p.negotiate_version([1]) is None  # version 1's heartbeats are not this one's


def test_capability_negotiation_ignores_unknown() -> None:
    assert p.negotiate_capabilities(["future.thing", p.CAP_RENEW]) == [p.CAP_RENEW]


BASE = dict(
    model_id="Qwen/Qwen2-VL-2B",
    model_revision="abc123",
    encoder_config={"patch_size": 14, "merge": 2},
    dtype="bfloat16",
    hidden_size=1536,
    protocol_version=1,
)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "Qwen/Qwen2-VL-7B"},
        {"model_revision": "def456"},
        {"encoder_config": {"patch_size": 16, "merge": 2}},
        {"encoder_config": {"patch_size": 14, "merge": 2, "extra": True}},
        {"dtype": "float16"},
        {"hidden_size": 3584},
        {"protocol_version": 2},
    ],
    ids=lambda c: next(iter(c)),
)
def test_fingerprint_changes_when_any_input_changes(change: dict[str, object]) -> None:
    assert p.fingerprint(**{**BASE, **change}) != p.fingerprint(**BASE)  # type: ignore[arg-type]


def test_fingerprint_is_stable_and_order_independent() -> None:
    reordered = {**BASE, "encoder_config": {"merge": 2, "patch_size": 14}}
    assert p.fingerprint(**reordered) == p.fingerprint(**BASE)  # type: ignore[arg-type]
    assert len(p.fingerprint(**BASE)) == 32  # type: ignore[arg-type]


def test_push_offer_of_zero_bytes_is_refused_by_the_decoder() -> None:
    frame = msgspec.msgpack.encode(
        {"t": "push_offer", "session_id": "s", "push_id": "p", "mm_hash": "h", "nbytes": 0}
    )
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_push_reply_with_unknown_status_is_refused_by_the_decoder() -> None:
    frame = msgspec.msgpack.encode(
        {"t": "push_reply", "session_id": "s", "push_id": "p", "status": "maybe"}
    )
    with pytest.raises(p.ProtocolError):
        p.decode(frame)


def test_push_capability_is_negotiated_like_the_others() -> None:
    assert p.CAP_PUSH in p.LOCAL_CAPABILITIES
    assert p.negotiate_capabilities([p.CAP_PUSH, "push.v9"]) == [p.CAP_PUSH]
    assert p.negotiate_capabilities([p.CAP_RENEW]) == [p.CAP_RENEW]


def test_hello_without_push_fields_still_decodes() -> None:
    hello = p.Hello(versions=[2], session_id="s", client_name="c", fingerprint="f")
    decoded = p.decode(p.encode(hello))
    assert isinstance(decoded, p.Hello) and decoded.push_name == "" and decoded.data_plane is None
