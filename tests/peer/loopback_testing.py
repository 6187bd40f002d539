"""Producers and consumers in this process on `LoopbackTransport`: the logic tier.

The data plane is the project's own in-process transport (ecshare/transport/
loopback.py), not a mock: the contract suite (tests/transport/test_transport_
contract.py) holds it and real NIXL to the same promises. Everything else is
real: the control plane is ZMQ with CURVE on 127.0.0.1, and the Producer,
Consumer, stores and regions are the ones a deployment runs. What is skipped is
NIXL's agent start-up and a producer process's, so these tests run in a fraction
of the time; the promises about the real data plane across processes keep their
tests on NIXL.

Every node of one test joins that test's own `Fabric`, so tests never see each
other's transports. Both ends of a link must be loopback: a link refuses a peer
whose data plane differs.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
from peer_testing import FINGERPRINT, Started, config_of

from ecshare.peer import Consumer, Node, Producer
from ecshare.peer.node import node_name
from ecshare.transport.loopback import Completion, Fabric, LoopbackTransport

MakeLoopProducer = Callable[..., tuple[Node, Producer]]
MakeLoopConsumer = Callable[..., tuple[Node, Consumer]]


@pytest.fixture
def fabric() -> Fabric:
    return Fabric()


def loop_node(
    fabric: Fabric,
    role: str,
    *layers: Mapping[str, Any],
    completion: Completion = Completion.SYNC,
    steps: int = 1,
) -> Node:
    config = config_of(*layers)
    transport = LoopbackTransport(
        node_name(config, role), fabric=fabric, completion=completion, steps=steps
    )
    try:
        return Node.create(config, role, transport=transport)
    except BaseException:
        transport.close()
        raise


@pytest.fixture
def loop_producer(fabric: Fabric) -> Iterator[MakeLoopProducer]:
    """`make_producer`, on the test's fabric: entries put, then started."""
    started = Started()

    def make(
        *layers: Mapping[str, Any],
        entries: Mapping[str, int] | None = None,
        fingerprint: str = FINGERPRINT,
        completion: Completion = Completion.SYNC,
        steps: int = 1,
    ) -> tuple[Node, Producer]:
        node = loop_node(fabric, "producer", *layers, completion=completion, steps=steps)
        return started.producer(node, entries, fingerprint)

    yield make
    started.close()


@pytest.fixture
def loop_consumer(fabric: Fabric) -> Iterator[MakeLoopConsumer]:
    """`make_consumer`, on the test's fabric."""
    started = Started()

    def make(*layers: Mapping[str, Any], fingerprint: str = FINGERPRINT) -> tuple[Node, Consumer]:
        return started.consumer(loop_node(fabric, "consumer", *layers), fingerprint)

    yield make
    started.close()
