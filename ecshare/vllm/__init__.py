"""The vLLM EC connector. Only this package imports vllm.

--ec-transfer-config '{"ec_connector": "ECShareConnector",
                       "ec_connector_module_path": "ecshare.vllm", ...}'
"""

from ecshare.vllm.connector import ECShareConnector, ECShareMetadata, ECShareStats

__all__ = ["ECShareConnector", "ECShareMetadata", "ECShareStats"]
