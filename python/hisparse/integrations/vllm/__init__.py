"""hisparse inside vLLM 0.33.0: a KV connector that backs vLLM's own HiSparse path with hisparse's policy.

Turn it on with one flag (``kv_connector_module_path`` makes vLLM load our class; its name switches vLLM's
HiSparse path on)::

    vllm serve deepseek-ai/DeepSeek-V3.2 --tensor-parallel-size 8 --kv-cache-dtype fp8_ds_mla \\
        --kv-transfer-config '{"kv_connector": "HiSparseConnector",
                               "kv_connector_module_path": "hisparse.integrations.vllm",
                               "kv_role": "kv_both",
                               "kv_connector_extra_config": {"host_pool_gib": 384, "policy": "coldest"}}'

``kv_connector_extra_config``: ``host_pool_gib`` (vLLM's, required), ``policy`` (``coldest``, the default,
or ``fifo``: exactly vLLM's decisions), and for ``coldest`` the heat counting's ``heat_interval`` (steps
between summaries, 32), ``heat_coldest`` / ``heat_hottest`` (pages ranked per request, 128 / 32) and
``heat_layer_stride`` (count in every n-th index group, 8). Any other key is refused (a misspelt one would
otherwise leave its option at the default). The package also registers a
``vllm.general_plugins`` entry point (:func:`register`), loaded in every vLLM process, which warns up front
on an unsupported vLLM.

Why this design (and not hisparse allocating blocks itself)
-----------------------------------------------------------
vLLM 0.33 already routes sparse-MLA reads through a per-request hot buffer when HiSparse is on: its spec
managers allocate the host source, resident and hot blocks from *its* ``BlockPool``, its layout packs the
61 (or 78) layers into resident/hot groups, its worker mirrors rows and restores pages, and its attention
backends resolve top-K through the hot buffer. A second allocator over the same tensors cannot work: the
groups share block memory, so two owners of one id corrupt KV (what the previous adapter did). So vLLM's pool
stays the one owner of every block id, and we replace only the *policy* and the cost of vLLM's bookkeeping.
The scheduler-side ``HiSparseCoordinator`` (built in ``HiSparseConnector.bind_kv_cache_manager``) becomes
:class:`~hisparse.integrations.vllm.bookkeeping.Bookkeeping` (``policy: fifo``: vLLM's decisions, its state
kept in the Rust core: vLLM's block rows, ``BlockRows``, and its page lifecycle, ``PageBook``), or under
``coldest`` its subclass :class:`~hisparse.integrations.vllm.coordinator.HisparseCoordinator`, which decides

- which pages a request releases and in what order (= the pool's reuse order: vLLM's free queue is FIFO),
  by the selection heat the resolver reports, in the core's ``coldest`` order (coldest, unlisted, hottest;
  ``PoolPolicy`` in Rust, ``rust/core/src/pool_policy.rs``);
- when a request takes a hot region: under a low pool only when what it releases frees more blocks than the
  region costs (vLLM moves every scheduled request once the pool runs low, even one whose pages free less
  than its 6 x 64-block hot region), and when its admission window fills unless its pages, at its longest,
  never could (vLLM moves every request there);
- when a waiting request is admitted (through ``get_num_new_matched_tokens``, whose None makes vLLM wait):
  only while the pool keeps room for the running requests' hot regions and growth after the new request's
  peak (no region is counted for a request too short ever to take one). vLLM counts released pages as free,
  admits against them, and then preempts running requests. Once one request waits, the rest of the queue
  waits behind it, so vLLM's first-come, first-served order holds.
- what a short request admitted on a prefix hit reads from: its whole prefix restored to resident pages
  (``restore.py``), where vLLM gives any prefix hit a hot region, two thirds of a 1 GiB GLM-5.3 pool.

Everything else is vLLM's and keeps working on its defaults: async scheduling, prefix caching on GPU and
host-only prefixes, preemption, MTP lookahead, TP > 1 (the metadata is vLLM's dataclasses, plus a heat
field; the Rust state stays in the engine-core process), refusals (an allocation that cannot be backed is
``allocate_slots`` returning None: vLLM waits or preempts; nothing raises out of ``schedule()``).

Heat is counted in the workers, on the device, from vLLM's own resolver path: the connector's worker role
makes vLLM's index-group leader runtimes count the top-K they resolve (inside the forward vLLM captures in
CUDA graphs), ranks the counts every ``heat_interval`` steps with the data path's ranking, and sends the
core's ``HeatSummary`` back in the worker metadata (``connector.py``, ``heat.py``). The scheduler's
``PoolPolicy`` (Rust) turns it into release and reuse order, as the core's ``coldest`` policy does. The
counting has only run on CPU here (the CPU harness drives the same code); ``tests/test_vllm_heat_gpu.py`` is
its GPU check (run by ``benches/gpu_check.sh``).

A worker that dies and is replaced has lost its GPU cache, its pinned host pool and the transfers it had
in flight. vLLM's recovery is ``Scheduler.reset_prefix_cache(reset_running_requests=True,
reset_connector=True)``: every request is preempted and recomputes, and both pools forget their prefixes. The
coordinator gives back the pins of the dead worker's transfers first (``forget_worker_state``), without
which vLLM's pool reset fails (it does with vLLM's own connector); late reports of those transfers are
ignored. ``tests/test_vllm_rebuild.py`` rebuilds the harness's worker mid-serving and checks every row read.

What does not survive: one hot region shared by every index group. vLLM's layout gives each group of up to
12 layers its own hot blocks (``v1/hisparse/layout.py``); re-packing means changing that layout, the spec
managers, the worker binding and the attention handles: a fork.

The supported vLLM is pinned (:data:`SUPPORTED_VLLM`): the coordinator's internals are not a stable API, so
any other version is refused with a clear message rather than run with decisions that may not hold.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import ConfigError

SUPPORTED_VLLM = "0.33.0"

__all__ = ["SUPPORTED_VLLM", "HiSparseConnector", "check_vllm_version", "register"]


def check_vllm_version(version: str | None = None) -> str:
    """The installed vLLM's version; ``ConfigError`` unless it is :data:`SUPPORTED_VLLM`."""
    if version is None:
        try:
            import vllm
        except ImportError as e:
            raise ConfigError(f"hisparse's vLLM integration needs vllm=={SUPPORTED_VLLM}; vLLM is not installed "
                              f"({e})") from None
        version = getattr(vllm, "__version__", "unknown")
    if version.split("+")[0] != SUPPORTED_VLLM:
        raise ConfigError(f"hisparse's vLLM integration supports vllm=={SUPPORTED_VLLM} only, found {version}: "
                          f"install vllm=={SUPPORTED_VLLM} or drop hisparse from --kv-transfer-config")
    return version


def register() -> None:
    """The ``vllm.general_plugins`` entry point, run in every vLLM process whether or not it uses hisparse:
    on an unsupported vLLM it logs why hisparse's connector will refuse to load, and leaves vLLM running
    (vLLM does not catch what a plugin raises). The connector itself is chosen by ``--kv-transfer-config``
    and refuses to load on any other vLLM (``ConfigError``)."""
    try:
        check_vllm_version()
    except ConfigError as e:
        logging.getLogger(__name__).warning("%s", e)


def __getattr__(name: str) -> Any:
    # vLLM loads ``HiSparseConnector`` from this module by name; import vLLM only then, after the version check.
    if name == "HiSparseConnector":
        check_vllm_version()
        from .connector import HiSparseConnector

        return HiSparseConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
