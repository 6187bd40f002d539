"""Authentication and compatibility: who gets a Welcome, and what everyone else is told.

Who is admitted is the control plane's promise (ZMQ with CURVE, always real here).
The producers that only refuse run in this process on `LoopbackTransport`
(tests/peer/loopback_testing.py), the project's own in-process data plane, held to
NIXL's contract by tests/transport/test_transport_contract.py, not a mock; the
insecure mode runs end to end across processes over NIXL, and `ecshare serve`
without keys as a real command.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("nixl._api")

from loopback_testing import MakeLoopConsumer, MakeLoopProducer
from peer_testing import (
    FAST,
    FINGERPRINT,
    FakeProducer,
    Keyring,
    MakeConsumer,
    MakeRawSession,
    SpawnProducer,
    child_env,
    expected,
    flags,
    stored_bytes,
)

from ecshare import protocol as p
from ecshare.apps.ready import READY_PREFIX
from ecshare.control import ControlConfigError
from ecshare.peer import Consumer, FailureReason, FetchFailed

pytestmark = pytest.mark.timeout(60)

REFUSED = (FailureReason.AUTH_FAILED, FailureReason.PEER_UNREACHABLE)


def _fetch_error(consumer: Consumer, h: str, address: str) -> FetchFailed:
    """The typed failure of fetching `h` from `address` (a success fails the test)."""
    error = consumer.fetch([h], [address])[0].exception(timeout=10)
    assert isinstance(error, FetchFailed), error
    return error


def test_consumer_without_key_gets_no_metadata_and_a_clear_error(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    raw_session: MakeRawSession,
    keyring: Keyring,
) -> None:
    h = "guarded"
    _pnode, producer = loop_producer(keyring.producer_config(), entries={h: 65536})

    # No key at all: this consumer runs insecure against a CURVE producer.
    node, consumer = loop_consumer({"insecure": True})
    error = _fetch_error(consumer, h, producer.address)
    assert error.reason in REFUSED, error
    assert "CURVE" in error.detail or "welcome" in error.detail, error.detail
    assert node.transport.peers == []  # the producer's agent metadata never arrived
    assert node.store.get(h) is None

    # A valid key pair that is not on the producer's allow-list.
    node, consumer = loop_consumer(keyring.consumer_config(stranger=True))
    error = _fetch_error(consumer, h, producer.address)
    assert error.reason is FailureReason.AUTH_FAILED, error
    assert "allow-list" in error.detail, error.detail
    assert node.transport.peers == []
    assert consumer.counters["peer_failures.auth_failed"] >= 1

    # The same, message by message: a Hello without CURVE is never answered.
    session = raw_session(producer.address, insecure=True)
    session.client.send(
        p.Hello(
            versions=list(p.SUPPORTED_VERSIONS),
            session_id=session.session_id,
            client_name="no-key",
            fingerprint=FINGERPRINT,
        )
    )
    assert session.client.recv(timeout_ms=1000) is None

    assert producer.session_count() == 0
    assert producer.counters["sessions_opened"] == 0
    assert producer.counters["granted"] == 0


def test_insecure_mode_works_only_when_configured(
    spawn_producer: SpawnProducer,
    make_consumer: MakeConsumer,
    keyring: Keyring,
) -> None:
    # Both sides insecure, by explicit configuration: it works, byte-exact.
    producer = spawn_producer(synthetic="1MiB:1,100003:1", config={"insecure": True})
    node, consumer = make_consumer({"insecure": True})
    results = [
        f.result(timeout=10) for f in consumer.fetch(list(producer.sizes), [producer.address])
    ]
    for result, (h, nbytes) in zip(results, producer.sizes.items(), strict=True):
        assert result.nbytes == nbytes
        np.testing.assert_array_equal(stored_bytes(node, h), expected(h, nbytes))

    # A consumer configured with keys never falls back to an insecure producer.
    node, consumer = make_consumer(keyring.consumer_config())
    error = _fetch_error(consumer, next(iter(producer.sizes)), producer.address)
    assert error.reason in REFUSED, error
    assert error.detail, error
    assert node.transport.peers == []

    # Neither side is insecure by default: without keys, each refuses to start.
    with pytest.raises(ControlConfigError, match="client_secret_key_file"):
        make_consumer({})
    serve = subprocess.run(
        [sys.executable, "-m", "ecshare", "serve", "--synthetic", "4KiB:1", *flags(FAST)],
        capture_output=True,
        text=True,
        env=child_env(),
        timeout=60,
    )
    assert serve.returncode != 0
    assert READY_PREFIX not in serve.stdout
    assert "server_secret_key_file" in serve.stderr and "insecure" in serve.stderr


def test_fingerprint_mismatch_is_a_typed_refusal(
    loop_producer: MakeLoopProducer,
    loop_consumer: MakeLoopConsumer,
    raw_session: MakeRawSession,
    keyring: Keyring,
) -> None:
    h = "model-a-item"
    _pnode, producer = loop_producer(keyring.producer_config(), entries={h: 65536})

    node, consumer = loop_consumer(keyring.consumer_config(), fingerprint="another-model")
    error = _fetch_error(consumer, h, producer.address)
    assert error.reason is FailureReason.INCOMPATIBLE, error
    assert "fingerprint" in error.detail, error.detail
    assert node.transport.peers == []

    session = raw_session(producer.address, fingerprint="another-model")
    reply = session.hello()
    assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.FINGERPRINT_MISMATCH, reply
    assert producer.session_count() == 0
    assert producer.counters["refused_fingerprint"] == 2


def test_version_mismatch_is_a_typed_refusal(
    loop_producer: MakeLoopProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    _, producer = loop_producer(keyring.producer_config())
    session = raw_session(producer.address)

    reply = session.hello(versions=[99])

    assert isinstance(reply, p.Error), reply
    assert reply.code is p.ErrorCode.VERSION_MISMATCH
    assert "99" in reply.message
    assert producer.session_count() == 0
    assert producer.counters["refused_version"] == 1
    # Without a session, a FetchRequest gets nothing but NO_SESSION.
    refused = session.fetch("r1", "anything")
    assert isinstance(refused, p.Error) and refused.code is p.ErrorCode.NO_SESSION
    # The same client speaking a common version is welcomed.
    assert isinstance(session.hello(versions=[99, *p.SUPPORTED_VERSIONS]), p.Welcome)


def test_welcome_in_a_version_not_offered_is_refused_before_any_metadata_is_loaded(
    fake_producer: FakeProducer, make_consumer: MakeConsumer, keyring: Keyring
) -> None:
    """A producer that answers in a protocol version the consumer did not list: the
    session is refused as incompatible, naming both, and its data plane is never loaded."""
    fake = fake_producer
    node, consumer = make_consumer(keyring.consumer_config())
    future = consumer.fetch(["h"], [fake.address])[0]
    hello: p.Hello = fake.recv(p.Hello)
    assert hello.versions == list(p.SUPPORTED_VERSIONS) and 1 not in hello.versions
    fake.welcome(hello, [p.CAP_CHECKSUM_XXH3_64], version=1)

    error = future.exception(timeout=10)
    assert isinstance(error, FetchFailed), error
    assert error.reason is FailureReason.INCOMPATIBLE, error
    assert "protocol version 1" in error.detail and "'fake'" in error.detail, error.detail
    assert node.transport.peers == []
    assert consumer.counter_snapshot()["peer_failures.incompatible"] == 1


def test_a_consumer_of_protocol_version_1_is_refused_at_the_hello(
    loop_producer: MakeLoopProducer, raw_session: MakeRawSession, keyring: Keyring
) -> None:
    """Version 1 sent heartbeat numbers and push deadlines that this build no longer
    sends: a peer that speaks only 1 gets a VERSION_MISMATCH, not frames it cannot read."""
    _, producer = loop_producer(keyring.producer_config())
    reply = raw_session(producer.address).hello(versions=[1])
    assert isinstance(reply, p.Error) and reply.code is p.ErrorCode.VERSION_MISMATCH, reply
    assert "[1]" in reply.message and str(list(p.SUPPORTED_VERSIONS)) in reply.message
    assert producer.session_count() == 0 and producer.counters["refused_version"] == 1
