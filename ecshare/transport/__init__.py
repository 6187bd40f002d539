"""The data plane: the `DataTransport` interface and its NIXL implementation.

Both implementations (nixl.py, and the in-process loopback.py) keep their books
in one place, ledger.py: counters, each transfer's life, peers and their retirement.

Importing this package never imports NIXL; `NixlTransport` does, when created.

May import: ecshare.errors, ecshare.config, ecshare.protocol, ecshare.store.
"""

from ecshare.transport.base import (
    DataTransport,
    FailureKind,
    PeerInfo,
    ReadHandle,
    ReadState,
    ReadStatus,
    Segment,
    TransportError,
    WritingTransport,
    pair_segments,
    writer_of,
)
from ecshare.transport.nixl import NixlTransport

__all__ = [
    "DataTransport",
    "FailureKind",
    "NixlTransport",
    "PeerInfo",
    "ReadHandle",
    "ReadState",
    "ReadStatus",
    "Segment",
    "TransportError",
    "WritingTransport",
    "pair_segments",
    "writer_of",
]
