"""Integrations with inference engines. ``hisparse.integrations.vllm``: the vLLM 0.33.0 plugin (a
``HiSparseConnector`` that backs vLLM's own HiSparse path with hisparse's policy); it imports vLLM only when
vLLM asks for the connector."""
