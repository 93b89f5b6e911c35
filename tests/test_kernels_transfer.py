"""Page copies as DMA (hisparse.kernels.transfer): the copy plan is checked on the CPU by running each planned 2D
copy with memmove and comparing every byte with the Rust reference's copy_blocks; the copies themselves, on a
side stream ordered by events, need a GPU."""

import ctypes
import random

import pytest
import torch

from hisparse import _core
from hisparse.kernels.transfer import page_copies, to_device_async

BS, RB, L = 4, 32, 3


def run_on_cpu(copies) -> None:
    for c in copies:
        for row in range(c.height):
            ctypes.memmove(c.dst + row * c.dst_pitch, c.src + row * c.src_pitch, c.width)


def buf(t: torch.Tensor) -> tuple[int, int]:
    return t.data_ptr(), t.numel()


def layers(kind: str, rows: int, seed: int) -> list[torch.Tensor]:
    """Layers of one tensor (evenly spaced), separate tensors, or evenly spaced with a stride past max_pitch."""
    g = torch.Generator().manual_seed(seed)
    if kind == "separate":
        return [torch.randint(0, 256, (rows + 3 * i, RB), dtype=torch.uint8, generator=g)[: rows] for i in range(L)]
    return list(torch.randint(0, 256, (L, rows, RB), dtype=torch.uint8, generator=g))


# 3 blocks of pitch: the layers of one tensor (16 blocks apart) are copied one by one, in runs of 3 blocks at most.
@pytest.mark.parametrize("kind, max_pitch", [("one", 2**31 - 1), ("separate", 2**31 - 1), ("one", 3 * BS * RB)])
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_planned_copies_move_what_copy_blocks_moves(kind, max_pitch, to_host, seed):
    rng = random.Random(seed)
    gpu, host = layers(kind, 16 * BS, seed), layers(kind, 24 * BS, seed + 50)
    first = rng.randrange(10)
    run = [(first + i, first + 2 + i) for i in range(4)]  # consecutive on both sides: one copy
    taken = {p[1] if to_host else p[0] for p in run}
    free = [d for d in range(24 if to_host else 16) if d not in taken]
    extra = [(rng.randrange(16), d) if to_host else (d, rng.randrange(24)) for d in rng.sample(free, 4)]
    pairs = [*run, *extra, (-1, 3), (5, -2)]
    rng.shuffle(pairs)
    want_gpu, want_host = [t.clone() for t in gpu], [t.clone() for t in host]
    table = torch.tensor(pairs, dtype=torch.int64)
    _core._ref_copy(buf(table), BS, RB, to_host, [buf(t) for t in want_gpu], [buf(t) for t in want_host])
    copies = page_copies(pairs, gpu_layers=[t.data_ptr() for t in gpu], host_layers=[t.data_ptr() for t in host],
                         block_bytes=BS * RB, to_host=to_host, max_pitch=max_pitch)
    run_on_cpu(copies)
    assert all(torch.equal(a, b) for a, b in zip(gpu + host, want_gpu + want_host, strict=True))
    per_layer = 1 if kind == "one" and max_pitch == 2**31 - 1 else L
    run_copies = -(-len(run) // max(1, max_pitch // (BS * RB)))  # one, but for a pitch that caps its width
    assert len(copies) <= per_layer * (run_copies + len(extra)), "the run of four pairs is one copy"
    assert all(max(c.dst_pitch, c.src_pitch) <= max_pitch for c in copies)


def test_layers_must_pair_up():
    with pytest.raises(ValueError, match="same positive number"):
        page_copies([(0, 0)], gpu_layers=[], host_layers=[], block_bytes=16, to_host=True)
    with pytest.raises(ValueError, match="same positive number"):
        page_copies([(0, 0)], gpu_layers=[0, 64], host_layers=[0], block_bytes=16, to_host=True)


def gpu_layers_like(kind: str, cpu: list[torch.Tensor], pinned: bool) -> list[torch.Tensor]:
    """``cpu``'s layers on the device (or pinned), laid out as ``kind`` says: views of one [L, rows, rb] tensor, as
    DataPath allocates them (one 2D copy spans every layer), or layers at uneven distances (a copy per layer).
    Separately allocated tensors are not enough for the latter: torch's allocator often spaces them evenly."""
    if kind == "one":
        stacked = torch.stack(cpu)
        return list(stacked.pin_memory() if pinned else stacked.cuda())
    gaps = [256 * (i + 1) for i in range(len(cpu))]
    arena = torch.empty(sum(t.numel() for t in cpu) + sum(gaps), dtype=torch.uint8,
                        **(dict(pin_memory=True) if pinned else dict(device="cuda")))
    out, at = [], 0
    for t, gap in zip(cpu, gaps, strict=True):
        at += gap
        out.append(arena[at:at + t.numel()].view(t.shape).copy_(t))
        at += t.numel()
    return out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", ["one", "separate"])
def test_page_mover_restores_and_materializes_like_copy_blocks(kind):
    from hisparse.kernels.transfer import PageMover

    gpu_cpu, host_cpu = layers(kind, 16 * BS, 1), layers(kind, 24 * BS, 2)
    gpu, host = gpu_layers_like(kind, gpu_cpu, pinned=False), gpu_layers_like(kind, host_cpu, pinned=True)
    want_gpu, want_host = [t.clone() for t in gpu_cpu], [t.clone() for t in host_cpu]
    mover = PageMover(gpu, host, BS)
    restores, copies = [(1, 2), (2, 3), (7, 0)], [(3, 5), (4, 6), (9, 11)]
    # The multi-layer layout DataPath uses moves each run of blocks in one copy of height L.
    planned = mover.copies(restores, to_host=False) + mover.copies(copies, to_host=True)
    assert all(c.height == (L if kind == "one" else 1) for c in planned)
    assert len(planned) == (1 if kind == "one" else L) * 4  # runs: (1-2, 2-3), (7, 0), (3-4, 5-6), (9, 11)
    for pairs, to_host in ((restores, False), (copies, True)):
        table = torch.tensor(pairs, dtype=torch.int64)
        _core._ref_copy(buf(table), BS, RB, to_host, [buf(t) for t in want_gpu], [buf(t) for t in want_host])
    mover.restore(restores)
    done = mover.materialize(copies)
    done.synchronize()
    torch.cuda.synchronize()
    assert all(torch.equal(a.cpu(), b) for a, b in zip(gpu, want_gpu, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(host, want_host, strict=True))
    assert torch.equal(to_device_async([5, 6], torch.int32, gpu[0].device).cpu(), torch.tensor([5, 6]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_forward_waits_for_restores_but_not_for_materializations():
    """A long copy to the host in flight; a restore after it: the current stream passes the restore's event while
    the copy to the host still runs (one stream per direction, the wait recorded right after the restores)."""
    from hisparse.kernels.transfer import PageMover

    blocks, bs, rb = 1024, 64, 4096  # 256 MiB a side: milliseconds of DMA
    gpu = list(torch.zeros(1, blocks * bs, rb, dtype=torch.uint8, device="cuda"))
    host = list(torch.zeros(1, blocks * bs, rb, dtype=torch.uint8).pin_memory())
    mover = PageMover(gpu, host, bs)
    done = mover.materialize([(b, b) for b in range(1, blocks)])
    mover.restore([(0, 0)])
    after_restore = torch.cuda.Event()
    after_restore.record()
    after_restore.synchronize()
    assert not done.query(), "the current stream waited for the copies to the host"
    done.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_what_the_current_stream_enqueues_after_a_restore_sees_the_restored_pages():
    """A long restore (256 MiB: milliseconds of DMA) into an idle device, then at once, on the current stream, a
    read of every restored block and an event. The read must see the host's bytes, and by the time the event has
    passed the restores must be done: without the current stream's wait for the restores' event, the read would
    run while the DMA does (and see the zeros the blocks held) and the event would pass at once."""
    from hisparse.kernels.transfer import PageMover

    blocks, bs, rb = 1024, 64, 4096
    gpu = list(torch.zeros(1, blocks * bs, rb, dtype=torch.uint8, device="cuda"))
    host = list(torch.full((1, blocks * bs, rb), 0xA5, dtype=torch.uint8).pin_memory())
    mover = PageMover(gpu, host, bs)
    torch.cuda.synchronize()
    mover.restore([(b, b) for b in range(blocks)])
    seen = gpu[0].view(blocks, -1)[:, -16:].clone()  # the last bytes of every block, read on the current stream
    after = torch.cuda.Event()
    after.record()
    after.synchronize()
    assert mover.h2d.query(), "the current stream ran past the restores before they were done"
    assert bool((seen == 0xA5).all()), "the current stream read blocks the restore had not written yet"
