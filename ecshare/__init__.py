"""ecshare: peer-to-peer sharing of multimodal encoder outputs between LLM instances.

The core imports with only its core dependencies (pyzmq, msgspec, numpy,
sortedcontainers, xxhash, prometheus_client); torch, nixl and vllm are optional
and imported only by the parts that need them (`ecshare.transport.nixl`, `ecshare.vllm`).
"""

# Imported for its effect: it adds the exporter that serves a started peer on
# `metrics_port` (ecshare.peer.thread.add_exporter). `peer/` never imports it.
from ecshare import metrics as _metrics  # noqa: F401
from ecshare.config import Config, ConfigError, load_config
from ecshare.errors import ECShareError
from ecshare.peer import (
    Consumer,
    FailureReason,
    FetchFailed,
    FetchItem,
    FetchResult,
    Node,
    Producer,
    start_consumer,
    start_producer,
)
from ecshare.protocol import PROTOCOL_VERSION, ProtocolError, fingerprint
from ecshare.store import Region, Store

__version__ = "0.1.0"

__all__ = [
    "PROTOCOL_VERSION",
    "Config",
    "ConfigError",
    "Consumer",
    "ECShareError",
    "FailureReason",
    "FetchFailed",
    "FetchItem",
    "FetchResult",
    "Node",
    "Producer",
    "ProtocolError",
    "Region",
    "Store",
    "fingerprint",
    "load_config",
    "start_consumer",
    "start_producer",
]
