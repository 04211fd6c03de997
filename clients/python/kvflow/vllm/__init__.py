"""vLLM integration: KvflowConnector, loadable by vLLM with

    --kv-transfer-config '{"kv_connector": "KvflowConnector",
                           "kv_connector_module_path": "kvflow.vllm",
                           "kv_role": "kv_producer", ...}'

Where vLLM is importable the connector subclasses vLLM's own
KVConnectorBase_V1; otherwise kvflow.vllm._shim's mirror of it."""

from .connector import (HAVE_VLLM, ConfigError, KVConnectorBase_V1, KVConnectorRole, KvflowConnector,  # noqa: F401
                        KvflowHandshakeMetadata, KvflowMetadata, cache_tensors)
