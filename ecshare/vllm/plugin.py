"""vLLM general plugin: registers `ECShareConnector` by name with vLLM's EC connector factory.

Installing ecshare declares it as a `vllm.general_plugins` entry point
(pyproject.toml), which vLLM loads in every process it starts (API server,
engine core, workers) before it builds a connector, so that

    --ec-transfer-config '{"ec_connector": "ECShareConnector", "ec_role": ...}'

works with no `ec_connector_module_path`. Spelling the module path
(`"ecshare.vllm"`) still works, and loads the same class.

vLLM may load plugins more than once in a process, and another plugin (or a
vLLM release) may have registered the name first: registering is idempotent
and leaves an existing entry alone. Importing this module imports neither
vllm nor torch; `register` imports only vLLM's factory, and the connector
itself is imported when vLLM first asks for it.
"""

from __future__ import annotations

import logging

__all__ = ["CONNECTOR_CLASS", "CONNECTOR_MODULE", "CONNECTOR_NAME", "register"]

CONNECTOR_NAME = "ECShareConnector"
CONNECTOR_MODULE = "ecshare.vllm.connector"
CONNECTOR_CLASS = "ECShareConnector"

log = logging.getLogger(__name__)


def register() -> bool:
    """Register the connector name with vLLM; True if this call added it.

    Never raises: a plugin that raises is logged by vLLM and skipped, and the
    user would only learn of it from "Unsupported connector type" later.
    """
    try:
        from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
    except Exception as exc:  # vLLM without EC connectors, or one that fails to import
        log.warning("ecshare: cannot register %s with vLLM: %s", CONNECTOR_NAME, exc)
        return False
    if CONNECTOR_NAME in ECConnectorFactory._registry:
        return False
    try:
        ECConnectorFactory.register_connector(CONNECTOR_NAME, CONNECTOR_MODULE, CONNECTOR_CLASS)
    except ValueError:  # registered meanwhile by another thread: the same outcome
        return False
    return True
