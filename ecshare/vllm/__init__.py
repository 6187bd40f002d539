"""The vLLM EC connector. Only this package imports vllm.

--ec-transfer-config '{"ec_connector": "ECShareConnector", "ec_role": ..., ...}'

Installing ecshare registers the name with vLLM (`plugin`, a `vllm.general_plugins`
entry point); `"ec_connector_module_path": "ecshare.vllm"` is needed only where
`VLLM_PLUGINS` leaves that plugin out. The connector classes are loaded on first
access, so that the modules here that need no vllm (`servers`, `tiny_model`) import
without it.

May import: the core (ecshare.errors, ecshare.counts, ecshare.config, ecshare.protocol,
ecshare.store, ecshare.transport, ecshare.control, ecshare.peer, ecshare.metrics), never
ecshare.apps.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ecshare.vllm.connector import ECShareConnector, ECShareMetadata, ECShareStats

__all__ = ["ECShareConnector", "ECShareMetadata", "ECShareStats"]


def __getattr__(name: str) -> Any:
    # vLLM loads the connector with getattr(import_module("ecshare.vllm"), name).
    if name in __all__:
        from ecshare.vllm import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
