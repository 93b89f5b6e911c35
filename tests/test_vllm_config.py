"""The version pin and configuration errors, as a user would meet them."""

from __future__ import annotations

import pytest

H = pytest.importorskip("vllm_harness")
vllm = pytest.importorskip("vllm")

from hisparse.errors import ConfigError  # noqa: E402

pytestmark = pytest.mark.vllm


def test_pin_holds_whatever_module_path_names_the_connector(monkeypatch):
    """The pin is checked only in the package's ``__getattr__``: naming the submodule that defines the class
    (``kv_connector_module_path: hisparse.integrations.vllm.connector``, where the class visibly lives) loads
    and builds the connector on any vLLM version."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    setup = H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=4)  # on 0.33.0
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    cfg = KVTransferConfig(kv_connector="HiSparseConnector",
                           kv_connector_module_path="hisparse.integrations.vllm.connector",
                           kv_role="kv_both", kv_connector_extra_config={"host_pool_gib": 1})
    with pytest.raises(ConfigError, match="found 0.34.0"):
        cls = KVConnectorFactory.get_connector_class(cfg)
        cls(setup.vllm_config, KVConnectorRole.SCHEDULER, setup.kv_cache_config)


def test_misspelt_extra_config_key_is_refused():
    """``{"polcy": "fifo"}`` (a typo) runs the default ``coldest`` policy without a word: a user asking for
    vLLM's own decisions silently gets hisparse's. Unknown keys of ``kv_connector_extra_config`` should be
    refused (or at least warned about) with the known keys listed."""
    with pytest.raises(ConfigError, match="polcy"):
        H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=4, extra={"polcy": "fifo"})


@pytest.mark.parametrize("extra,match", [({"policy": "lru"}, "policy"), ({"heat_interval": 0}, "heat_interval"),
                                         ({"heat_coldest": "many"}, "heat_coldest"),
                                         ({"heat_layer_stride": 2.0}, "heat_layer_stride")])
def test_bad_values_are_clear_config_errors(extra, match):
    with pytest.raises(ConfigError, match=match):
        H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=4, extra=extra)


@pytest.mark.parametrize("host_pool_gib,match", [("lots", "could not convert"), (0, "must be positive"),
                                                 (-1, "must be positive")])
def test_bad_host_pool_is_vllms_clear_error(host_pool_gib, match):
    with pytest.raises(ValueError, match=match):
        H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=host_pool_gib)
