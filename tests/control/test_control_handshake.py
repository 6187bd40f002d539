"""The client's link state follows libzmq's events, and every refusal names its cause."""

from __future__ import annotations

import zmq

from ecshare.control.handshake import Handshake, LinkState
from ecshare.control.link import SocketEvent

ENDPOINT = "tcp://10.0.0.7:5555"
CLIENT_KEY = b"C" * 40
SERVER_KEY = b"S" * 40


def _event(kind: int, value: int = 0) -> SocketEvent:
    return SocketEvent(kind=kind, value=value, endpoint=ENDPOINT)


def _curve() -> Handshake:
    return Handshake(
        endpoint=ENDPOINT, insecure=False, client_key=CLIENT_KEY, server_key=SERVER_KEY
    )


def test_link_becomes_ready_then_disconnected_then_ready_again() -> None:
    link = _curve()
    assert link.state is LinkState.CONNECTING
    link.apply(_event(zmq.EVENT_CONNECTED))
    assert link.state is LinkState.CONNECTING  # TCP alone is not authentication
    link.apply(_event(zmq.EVENT_HANDSHAKE_SUCCEEDED))
    assert link.state is LinkState.READY and link.failure is None
    link.apply(_event(zmq.EVENT_DISCONNECTED))
    assert link.state is LinkState.DISCONNECTED
    link.apply(_event(zmq.EVENT_HANDSHAKE_SUCCEEDED))
    assert link.state is LinkState.READY
    assert link.counters["handshake_succeeded"] == 2


def test_refused_key_names_the_key_and_the_fix() -> None:
    link = _curve()
    link.apply(_event(zmq.EVENT_HANDSHAKE_FAILED_AUTH, 400))
    link.apply(_event(zmq.EVENT_DISCONNECTED))
    assert link.state is LinkState.AUTH_FAILED
    assert link.failure is not None
    assert f"producer at {ENDPOINT} rejected this consumer's CURVE key" in link.failure
    assert CLIENT_KEY.decode() in link.failure
    assert "allow-list" in link.failure


def test_one_bare_close_is_not_yet_a_refusal_two_are() -> None:
    link = _curve()
    link.apply(_event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32))
    assert link.state is LinkState.CONNECTING  # maybe a producer restarting
    link.apply(_event(zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, 32))
    assert link.state is LinkState.AUTH_FAILED
    assert link.failure is not None and SERVER_KEY.decode() in link.failure
    assert link.counters["handshake_failed"] == 2
    # libzmq keeps retrying after bare closes; if the producer comes round, so do we.
    link.apply(_event(zmq.EVENT_HANDSHAKE_SUCCEEDED))
    assert link.state is LinkState.READY and link.failure is None


def test_mechanism_mismatch_says_which_side_is_insecure() -> None:
    curve = _curve()
    curve.apply(
        _event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    )
    assert curve.failure is not None and "does not use CURVE" in curve.failure
    plain = Handshake(endpoint=ENDPOINT, insecure=True, client_key=None, server_key=None)
    plain.apply(
        _event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
    )
    assert plain.failure is not None and "requires CURVE" in plain.failure


def test_unknown_protocol_error_is_named() -> None:
    link = _curve()
    link.apply(
        _event(zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL, zmq.PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_HELLO)
    )
    assert link.failure is not None
    assert "PROTOCOL_ERROR_ZMTP_MALFORMED_COMMAND_HELLO" in link.failure
