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


def test_heat_options_under_fifo_are_named_as_unused(caplog):
    """``fifo`` makes vLLM's decisions, which no heat orders: its heat options do nothing, so the scheduler says
    so once (the worker does not count heat at all under fifo: ``register_kv_caches``). Under ``coldest``
    nothing is said."""
    with caplog.at_level("WARNING", logger="hisparse.integrations.vllm.connector"):
        H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=4,
                extra={"policy": "fifo", "heat_interval": 4, "heat_coldest": 8})
    warned = [r.getMessage() for r in caplog.records if r.name == "hisparse.integrations.vllm.connector"]
    assert len(warned) == 1 and "heat_coldest, heat_interval set, but policy fifo" in warned[0]
    caplog.clear()
    with caplog.at_level("WARNING", logger="hisparse.integrations.vllm.connector"):
        H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=4, extra={"heat_interval": 4})
    assert not [r for r in caplog.records if r.name == "hisparse.integrations.vllm.connector"]


@pytest.mark.parametrize("host_pool_gib", ["lots", 0, -1, None, True, float("nan"), float("inf"), -float("inf"),
                                           1e30, 2**20 + 1, [4]])
def test_a_bad_host_pool_is_refused_before_vllm_sizes_anything(host_pool_gib):
    """NaN and infinities used to fail deep in vLLM's planner, ``1e30`` to allocate until memory ran out,
    ``true`` to be read as 1 GiB."""
    with pytest.raises(ConfigError, match="host_pool_gib must be a number of GiB"):
        H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=host_pool_gib)


def test_a_host_pool_beyond_this_hosts_memory_is_refused_where_it_would_be_held(monkeypatch):
    """vLLM's rule (95% of the available memory) where the pool is held: the workers pin all of it, the
    scheduler keeps a record per block; a scheduler plans a pool far larger than its own host fine."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from hisparse.integrations.vllm import connector

    setup = H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=64)
    cls, vc, kc = type(setup.scheduler.connector), setup.vllm_config, setup.kv_cache_config
    monkeypatch.setattr(connector, "_available_host_bytes", lambda: 32 * 2**30)
    with pytest.raises(ConfigError, match=r"host_pool_gib = 64: the pinned pool needs 64.0 GiB .* 32.0 GiB"):
        cls(vc, KVConnectorRole.WORKER, kc)
    blocks = kc.hisparse_host_num_blocks
    monkeypatch.setattr(connector, "_available_host_bytes", lambda: blocks * 200)
    with pytest.raises(ConfigError, match=f"the scheduler's record of its {blocks:,} blocks"):
        cls(vc, KVConnectorRole.SCHEDULER, kc)


@pytest.mark.parametrize("policy", ["fifo", "coldest"])
def test_resident_groups_in_separate_pools_are_refused(policy):
    """Both policies touch and release a page's blocks in every resident group with one call to their pool,
    vLLM's one GPU pool: resident groups in pools of their own (not a layout vLLM 0.33 builds) are refused
    when the coordinator is made, rather than released into the wrong pool."""
    import copy

    from hisparse.integrations.vllm.coordinator import COORDINATORS

    setup = H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, host_pool_gib=4)
    manager = setup.scheduler.kv_cache_manager
    managers = tuple(manager.coordinator.single_type_managers)
    coordinator = setup.scheduler.connector.connector_scheduler.coordinator
    coordinator.resident_managers[-1].block_pool = copy.copy(coordinator.gpu_pool)
    with pytest.raises(ConfigError, match="do not share one GPU block pool"):
        COORDINATORS[policy](manager.kv_cache_config, managers, manager.max_model_len,
                             num_reprefillable_tokens=manager.coordinator.num_reprefillable_tokens)
