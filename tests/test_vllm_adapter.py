"""hisparse.integrations.vllm: imports without vLLM, implements every abstract method of vLLM's
KVConnectorBase_V1 with its signature, and drives the hooks through vLLM's call sequence."""

import inspect
from types import SimpleNamespace

import pytest
import torch

from hisparse.integrations import vllm as adapter

# The abstract methods of vLLM 0.33.0's KVConnectorBase_V1 (vllm/distributed/kv_transfer/kv_connector/v1/base.py)
# and their parameter names, plus the optional ones the adapter overrides.
ABSTRACT = {
    "start_load_kv": ["self", "forward_context", "kwargs"],
    "wait_for_layer_load": ["self", "layer_name"],
    "save_kv_layer": ["self", "layer_name", "kv_layer", "attn_metadata", "kwargs"],
    "wait_for_save": ["self"],
    "get_num_new_matched_tokens": ["self", "request", "num_computed_tokens"],
    "update_state_after_alloc": ["self", "request", "blocks", "num_external_tokens"],
    "build_connector_meta": ["self", "scheduler_output"],
}
OPTIONAL = {
    "register_kv_caches": ["self", "kv_caches"],
    "update_connector_output": ["self", "connector_output"],
    "request_finished": ["self", "request", "block_ids"],
    "build_connector_worker_meta": ["self"],
    "get_finished": ["self", "finished_req_ids"],
    "shutdown": ["self"],
}


def params(fn):
    return list(inspect.signature(fn).parameters)


def test_imports_without_vllm_and_has_the_methods():
    cls = adapter.HiSparseHooksConnector
    for name, names in {**ABSTRACT, **OPTIONAL}.items():
        assert callable(getattr(cls, name, None)), name
        assert params(getattr(cls, name)) == names, name
    assert params(cls.__init__) == ["self", "vllm_config", "role", "kv_cache_config"]
    assert issubclass(cls, adapter.KVConnectorBase_V1)
    assert hasattr(adapter.KVConnectorRole, "SCHEDULER") and hasattr(adapter.KVConnectorRole, "WORKER")


def test_implements_every_abstract_method_of_vllm():
    base = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.v1.base")
    assert adapter.HAVE_VLLM
    cls = adapter.HiSparseHooksConnector
    assert issubclass(cls, base.KVConnectorBase_V1)
    abstract = base.KVConnectorBase_V1.__abstractmethods__
    assert abstract and not getattr(cls, "__abstractmethods__", set())
    for name in abstract:
        ours, theirs = getattr(cls, name), getattr(base.KVConnectorBase_V1, name)
        assert ours is not theirs, f"{name} is not implemented"
        assert params(ours) == params(theirs), name
    for name in OPTIONAL:
        assert params(getattr(cls, name)) == params(getattr(base.KVConnectorBase_V1, name)), name
    assert issubclass(adapter.HiSparseHooksWorkerMetadata, base.KVConnectorWorkerMetadata)
    assert issubclass(adapter.HiSparseHooksMetadata, base.KVConnectorMetadata)


BS, RB, LAYERS, BLOCKS = 8, 32, 2, 40


def vllm_config():
    extra = dict(row_bytes=RB, layer_groups=[0, 0], top_k=16, hot_rows=32, num_host_blocks=256)
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra, is_kv_producer=False),
        cache_config=SimpleNamespace(block_size=BS),
        model_config=SimpleNamespace(max_model_len=256),
        scheduler_config=SimpleNamespace(max_num_seqs=4),
    )


def rows_of(rid, positions, layer):
    seed = sum(map(ord, rid)) * 97 + positions * 13 + layer * 5
    return ((seed[:, None] + torch.arange(RB)[None, :] * 3) % 251).to(torch.uint8)


def output(new=(), cached=(), scheduled=None, finished=(), preempted=(), resumed=()):
    return SimpleNamespace(
        scheduled_new_reqs=[SimpleNamespace(req_id=r, prompt_token_ids=[1] * n, num_computed_tokens=0)
                            for r, n in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=list(cached), resumed_req_ids=set(resumed),
                                              all_token_ids={}),
        num_scheduled_tokens=dict(scheduled or {}),
        finished_req_ids=set(finished),
        preempted_req_ids=set(preempted),
    )


def test_vllm_call_sequence_drives_the_hooks():
    cfg = vllm_config()
    kv_cache_config = SimpleNamespace(num_blocks=BLOCKS)
    sched = adapter.HiSparseHooksConnector(cfg, adapter.KVConnectorRole.SCHEDULER, kv_cache_config)
    work = adapter.HiSparseHooksConnector(cfg, adapter.KVConnectorRole.WORKER, kv_cache_config)
    caches = {f"model.layers.{i}.self_attn.attn": torch.zeros(BLOCKS, BS, RB, dtype=torch.uint8)
              for i in range(LAYERS)}
    work.register_kv_caches(caches)
    lens = {}

    def step(out):
        meta = sched.build_connector_meta(out)
        work.bind_connector_metadata(meta)
        work.start_load_kv(None)
        for rid, n in out.num_scheduled_tokens.items():
            pos = torch.arange(lens.get(rid, 0), lens.get(rid, 0) + n)
            for layer in range(LAYERS):
                work.worker.write(rid, pos, layer, rows_of(rid, pos, layer))
            lens[rid] = lens.get(rid, 0) + n
        work.wait_for_save()
        wmeta = work.build_connector_worker_meta()
        work.clear_connector_metadata()
        sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=wmeta))
        return meta

    for rid in ("a", "b"):
        sched.update_state_after_alloc(SimpleNamespace(request_id=rid, sampling_params=SimpleNamespace(max_tokens=60)),
                                       None, 0)
        assert sched.get_num_new_matched_tokens(SimpleNamespace(request_id=rid), 0) == (0, False)
    step(output(new=[("a", 100), ("b", 100)], scheduled={"a": 100, "b": 100}))
    for _ in range(40):  # the two outgrow the pool: cold pages go to the host
        step(output(cached=["a", "b"], scheduled={"a": 1, "b": 1}))
    # Read everything back through resolve + gather, as an attention backend would.
    meta = sched.build_connector_meta(output(cached=["a", "b"], scheduled={"a": 1, "b": 1}))
    work.bind_connector_metadata(meta)
    work.start_load_kv(None)
    for rid in ("a", "b"):
        for start in range(0, lens[rid], 16):
            pos = torch.arange(start, min(start + 16, lens[rid]))
            topk = torch.full((1, 16), -1, dtype=torch.int32)
            topk[0, : len(pos)] = pos.to(torch.int32)
            row_ids = work.resolve("model.layers.0.self_attn.attn", topk, [rid])
            for layer, name in enumerate(caches):
                got = work.gather(name, row_ids)[0, : len(pos)]
                assert torch.equal(got, rows_of(rid, pos, layer)), (rid, start, layer)
    for rid in ("a", "b"):
        pos = torch.tensor([lens[rid]])
        for layer in range(LAYERS):
            work.worker.write(rid, pos, layer, rows_of(rid, pos, layer))
        lens[rid] += 1
    work.wait_for_save()
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=work.build_connector_worker_meta()))
    work.clear_connector_metadata()
    assert sched.metrics()["steps"] == 42 and sched.metrics()["misses"] > 0
    # A preempted request is dropped (vLLM recomputes it) and admitted again when it resumes.
    step(output(cached=["a"], scheduled={"a": 1}, preempted=["b"]))
    assert "b" not in sched.scheduler
    lens["b"] = 0
    step(output(cached=["a", "b"], resumed=["b"], scheduled={"a": 1, "b": 64}))
    assert sched.scheduler.request_info("b")["seq_len"] == 64
    assert sched.request_finished(SimpleNamespace(request_id="a"), []) == (False, None)
    step(output(cached=["b"], scheduled={"b": 1}, finished=["a"]))
    assert "a" not in sched.scheduler


def test_settings_need_the_extra_config():
    with pytest.raises(adapter.ConfigError, match="row_bytes"):
        adapter.settings_from({}, block_size=8, max_model_len=64, max_running=2, num_gpu_blocks=32)
    s = adapter.settings_from(dict(row_bytes=656, layer_groups=[0, 0, 1], top_k=2048, host_pool_gib=1.0),
                              block_size=64, max_model_len=4096, max_running=2, num_gpu_blocks=32)
    assert s.layout.hot_rows == 4096 and s.num_host_blocks == (1 << 30) // (64 * 656 * 3)
