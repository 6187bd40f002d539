"""Without a valid CURVE key a peer learns nothing, and the producer counts the refusal.

A recording TCP relay sits between the client and a producer process, so the test
sees every byte the producer sent, not just what the client library chose to show.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import zmq

pytest.importorskip("nixl._api")

from peer_testing import FINGERPRINT, Keyring, SpawnProducer
from security_testing import curve_dealer, parse_zmtp, wire_recorder
from waiting import wait_until

from ecshare import protocol as p
from ecshare.control import KeyPair, load_keypair

pytestmark = pytest.mark.timeout(60)

HANDSHAKE_COMMANDS = {b"WELCOME", b"ERROR"}  # what a refused CURVE client may see
FAILURES = (
    "auth_rejected",
    "handshake_failed_auth",
    "handshake_failed_protocol",
    "handshake_failed_no_detail",
)


def _dealer(context: zmq.Context[Any], address: str, case: str, keyring: Keyring) -> Any:
    if case == "plaintext":
        sock = context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        return sock
    client = keyring.consumer
    server = keyring.producer.public
    if case == "unknown_key":
        client = load_keypair(keyring.stranger_secret)
    elif case == "wrong_server_key":
        server = KeyPair.generate().public
    return curve_dealer(context, address, server_public=server, client=client)


@pytest.mark.parametrize("case", ["unknown_key", "wrong_server_key", "plaintext", "authorized"])
def test_peer_without_a_valid_key_learns_nothing(
    case: str, spawn_producer: SpawnProducer, keyring: Keyring
) -> None:
    producer = spawn_producer(synthetic="64KiB:2", config=keyring.producer_config(), hooks=True)
    names = [h.encode() for h in producer.sizes]
    before = producer.stats()
    session_id = "probe-session"
    frames = [
        p.encode(
            p.Hello(
                versions=[2], session_id=session_id, client_name="probe", fingerprint=FINGERPRINT
            )
        ),
        p.encode(
            p.FetchRequest(
                session_id=session_id,
                request_id="r1",
                items=[p.ItemRequest(h) for h in producer.sizes],
            )
        ),
    ]
    context: zmq.Context[Any] = zmq.Context()
    with wire_recorder(producer.address) as recorder:
        dealer = _dealer(context, recorder.address, case, keyring)
        try:
            for frame in frames:
                dealer.send(frame)
            replies = []
            deadline = time.monotonic() + (5.0 if case == "authorized" else 1.5)
            while len(replies) < 2 and dealer.poll(
                max(0, int((deadline - time.monotonic()) * 1000))
            ):
                replies.append(p.decode(dealer.recv()))
        finally:
            dealer.close(linger=0)
            context.term()
        recorded = recorder.recorded()
    streams = [parse_zmtp(data) for data in recorded]
    after = producer.stats()
    print(f"{case}: {[(s.mechanism, s.commands, s.messages) for s in streams]}")

    if case == "authorized":
        # The control: the relay and the parser do see a real session's traffic.
        assert isinstance(replies[0], p.Welcome) and isinstance(replies[1], p.FetchReply)
        assert any(b"READY" in s.commands and s.messages >= 2 for s in streams), streams
        return
    assert replies == []
    assert streams, "the producer sent not even its greeting"
    for stream in streams:
        assert stream.mechanism in (b"", b"CURVE"), stream
        assert stream.messages == 0, stream
        assert set(stream.commands) <= HANDSHAKE_COMMANDS, stream
    assert not any(name in data for name in names for data in recorded)
    assert after["control"]["received"] == before["control"]["received"]
    assert after["sessions"] == 0 and after["counters"].get("sessions_opened", 0) == 0
    assert after["store"]["pins"] == 0

    # The producer counted the refusal (the monitor thread reports it a moment later).
    def refused() -> bool:
        control = producer.stats()["control"]
        return sum(control[k] for k in FAILURES) > sum(before["control"][k] for k in FAILURES)

    wait_until(refused, timeout_s=5.0, detail=lambda: producer.stats()["control"])
    if case == "unknown_key":
        assert producer.stats()["control"]["auth_rejected"] > before["control"]["auth_rejected"]
