"""Adapters from inference engines onto :mod:`hisparse.hooks`. ``hisparse.integrations.vllm``: vLLM 0.33's
KV-connector API; it imports without vLLM installed."""
