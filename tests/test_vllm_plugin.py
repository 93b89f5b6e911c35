"""The vLLM plugin's own pieces, without running vLLM's scheduler: version pin, entry point, heat
summaries and the Rust pool policy."""

from __future__ import annotations

import pytest
import torch

from hisparse import _core
from hisparse.errors import ConfigError
from hisparse.integrations import vllm as plugin
from hisparse.integrations.vllm.heat import summarize_heat


def test_only_the_pinned_vllm_is_accepted():
    assert plugin.check_vllm_version("0.33.0") == "0.33.0"
    assert plugin.check_vllm_version("0.33.0+cu130") == "0.33.0+cu130"
    with pytest.raises(ConfigError, match=r"supports vllm==0\.33\.0 only, found 0\.34\.0"):
        plugin.check_vllm_version("0.34.0")


def test_another_vllm_gets_a_warning_from_the_entry_point_and_a_refusal_from_the_connector(monkeypatch, caplog):
    vllm = pytest.importorskip("vllm")
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    plugin.register()  # vLLM runs this in every process: it must not raise
    assert "supports vllm==0.33.0 only, found 0.34.0" in caplog.text
    with pytest.raises(ConfigError, match="found 0.34.0"):
        plugin.HiSparseConnector  # noqa: B018 - what vLLM's connector factory does


def test_entry_point_is_declared():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    section = text.split('[project.entry-points."vllm.general_plugins"]', 1)[1]
    assert section.split("[", 1)[0].strip() == 'hisparse = "hisparse.integrations.vllm:register"'


def test_connector_class_is_found_by_vllms_factory():
    pytest.importorskip("vllm")
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector import HiSparseConnector as Native

    plugin.register()
    cfg = KVTransferConfig(kv_connector="HiSparseConnector", kv_connector_module_path="hisparse.integrations.vllm",
                           kv_role="kv_both", kv_connector_extra_config={"host_pool_gib": 1})
    cls = KVConnectorFactory.get_connector_class(cfg)
    assert cls is plugin.HiSparseConnector and issubclass(cls, Native) and cls.__name__ == "HiSparseConnector"


def test_heat_summary_is_coldest_first_among_candidates_then_decays():
    heat = torch.tensor([[5, 0, 3, 9, 1], [2, 2, 2, 2, 2]], dtype=torch.int32)
    candidates = torch.tensor([[1, 1, 1, 0, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    out = summarize_heat(heat, candidates, {"a": 0, "b": 1}, limit=3)
    assert out["a"] == ((1, 4, 2), (0, 1, 3), True)  # page 3 is not a candidate; page 0 was cut
    assert out["b"] == ((0, 1, 2), (2, 2, 2), True)
    assert heat.tolist() == [[2, 0, 1, 4, 0], [1, 1, 1, 1, 1]]
    assert summarize_heat(heat, candidates[:, :], {"a": 0}, limit=8)["a"][2] is False


def test_pool_policy_orders():
    p = _core.PoolPolicy()
    assert p.release_order("x", [1, 7, 3]) == [7, 3, 1]  # vLLM's order without heat
    p.report("x", [2, 7, 1], [0, 4, 8], False)
    assert p.release_order("x", [1, 2, 7, 9]) == [9, 2, 7, 1]
    assert p.refresh_order("x", [1, 2, 7]) == [7, 1]
    assert len(p) == 1
    p.forget("x")
    assert len(p) == 0
    with pytest.raises(ValueError, match="2 pages but 1 heat"):
        p.report("x", [1, 2], [3], False)
    assert not _core.PoolPolicy.worth_transition(64, 6, 384) and _core.PoolPolicy.worth_transition(65, 6, 384)
