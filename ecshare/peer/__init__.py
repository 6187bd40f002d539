"""Producer (grants reads) and Consumer (fetches), engine-agnostic.

May import: ecshare.errors, ecshare.counts, ecshare.config, ecshare.protocol, ecshare.store,
ecshare.transport, ecshare.control.
"""

from ecshare.peer.consumer import Consumer, FetchItem
from ecshare.peer.node import Node, start_consumer, start_producer
from ecshare.peer.producer import Producer
from ecshare.peer.pusher import PushOutcome, PushState
from ecshare.peer.transfer import FailureReason, FetchFailed, FetchResult, TransferState

__all__ = [
    "Consumer",
    "FailureReason",
    "FetchFailed",
    "FetchItem",
    "FetchResult",
    "Node",
    "Producer",
    "PushOutcome",
    "PushState",
    "TransferState",
    "start_consumer",
    "start_producer",
]
