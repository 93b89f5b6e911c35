"""Review of issue 8: what crosses processes, through vLLM's own transports rather than a bare pickle.

- Scheduler -> workers: ``SchedulerOutput`` (with our connector metadata) through vLLM's shared-memory
  ``MessageQueue`` (``shm_broadcast.py``: pickle at the highest protocol with its tensor dispatch table),
  as the multi-process executor broadcasts it for TP > 1.
- Workers -> scheduler: ``ModelRunnerOutput`` (with ``HisparseWorkerMetadata`` and heat reports) through a
  second ``MessageQueue`` (the workers' response queue).
- Engine core -> front end: what ``update_from_output`` returns (``EngineCoreOutputs``, with the scheduler's
  stats and the connector's stats) through vLLM's msgspec ``MsgpackEncoder`` / ``MsgpackDecoder``.
"""

from __future__ import annotations

import threading

import pytest

H = pytest.importorskip("vllm_harness")
pytest.importorskip("vllm")

pytestmark = pytest.mark.vllm


def _queue():
    from vllm.distributed.device_communicators.shm_broadcast import MessageQueue

    writer = MessageQueue(n_reader=1, n_local_reader=1)
    handle = writer.export_handle()
    box = []
    thread = threading.Thread(target=lambda: box.append(MessageQueue.create_from_handle(handle, 0)))
    thread.start()
    writer.wait_until_ready()
    thread.join()
    box[0].wait_until_ready()
    return writer, box[0]


class _QueuedWorker(H.FakeWorker):
    def __init__(self, setup, **kw):
        super().__init__(setup, **kw)
        self.down = _queue()
        self.up = _queue()
        self.carried = 0

    def execute(self, so):
        self.down[0].enqueue(so)
        out = super().execute(self.down[1].dequeue(timeout=30))
        self.up[0].enqueue(out)
        self.carried += 1
        return self.up[1].dequeue(timeout=30)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_outputs_cross_vllms_message_queues_and_msgpack(async_scheduling):
    from vllm.v1.engine import EngineCoreOutputs
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    setup = H.build(mode="hisparse", gpu_gib=1.0, max_model_len=8192, async_scheduling=async_scheduling,
                    host_pool_gib=20, extra={"heat_interval": 2})
    worker = _QueuedWorker(setup, layers=[0, 60])
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)
    sched = setup.scheduler
    update = sched.update_from_output
    decoded = []

    def update_and_ship(so, out):
        result = update(so, out)
        for outputs in result.values():
            decoded.append(decoder.decode(encoder.encode(outputs)))
        return result

    sched.update_from_output = update_and_ship
    stats = H.run(setup, worker, [H.Job(f"r{i}", H.prompt(i, 6000), 24) for i in range(3)])
    assert worker.carried == stats.steps and stats.rows_checked > 0
    assert any(o.scheduler_stats is not None and o.scheduler_stats.kv_connector_stats for o in decoded)
    counters = sched.connector.coordinator.counters
    assert counters["heat_summaries"] > 0 and not counters["heat_refused"], "heat crossed and was taken"
