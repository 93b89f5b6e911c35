// gather, copy_rows, copy_blocks and replay of cuda/SPEC.md: kernels that move rows and touch no state.
// `layers` holds 2 * L addresses: the GPU slabs of the L layers, then their host pools (pinned memory,
// read and written in place through unified addressing). A job (one row, or one block, of one layer) goes to
// one warp (rows) or one CTA (blocks), which computes its 64-bit base addresses once and copies with 32-bit
// offsets; every kernel strides over its jobs, so any grid is correct, and an entry outside its slab or pool
// is skipped. Destinations are the caller's to keep distinct (SPEC.md): nothing here looks for a repeat.
#include "common.cuh"

#define COPY_THREADS 256

__device__ __forceinline__ u32 warp_index() { return (blockIdx.x * blockDim.x + threadIdx.x) >> 5; }

__device__ __forceinline__ u32 warp_count() { return (gridDim.x * blockDim.x) >> 5; }

// dense[e, :] = slab[row_ids[e]] for the n = R * K elements, zeros where the row id is negative (or, a bad
// argument, past the slab).
extern "C" __global__ void __launch_bounds__(COPY_THREADS)
    hisparse_gather(const int* __restrict__ row_ids, const u8* __restrict__ slab, u8* __restrict__ dense, int n,
                    int rb, int slab_rows) {
  const u32 lane = threadIdx.x & 31;
  const u32 nv = (u32)rb >> 4;
  for (u32 e = warp_index(); e < (u32)n; e += warp_count()) {
    const int row = row_ids[e];
    uint4* dst = (uint4*)(dense + (u64)e * rb);
    if (row >= 0 && row < slab_rows) {
      copy_span((const uint4*)(slab + (u64)row * rb), dst, nv, lane, 32);
    } else {
      const uint4 zero = {0u, 0u, 0u, 0u};
      for (u32 c = lane; c < nv; c += 32) dst[c] = zero;
    }
  }
}

// copy_rows(pairs, direction): pairs int64 [n, 2] of (GPU row, host row), one warp per (pair, layer).
extern "C" __global__ void __launch_bounds__(COPY_THREADS)
    hisparse_copy_rows(const i64* __restrict__ pairs, int n, const u64* __restrict__ layers, int L, int rb,
                       int gpu_rows, int host_rows, int to_host) {
  const u32 lane = threadIdx.x & 31;
  const u32 nv = (u32)rb >> 4;
  for (u32 j = warp_index(); j < (u32)n * (u32)L; j += warp_count()) {
    const u32 p = j % (u32)n;
    const u32 l = j / (u32)n;
    const i64 gpu = pairs[2 * p];
    const i64 host = pairs[2 * p + 1];
    if (gpu < 0 || host < 0 || gpu >= gpu_rows || host >= host_rows) continue;
    uint4* g = (uint4*)(layers[l] + (u64)gpu * rb);
    uint4* h = (uint4*)(layers[L + l] + (u64)host * rb);
    if (to_host) {
      copy_span(g, h, nv, lane, 32);
    } else {
      copy_span(h, g, nv, lane, 32);
    }
  }
}

// copy_blocks(pairs, direction): pairs int32 [n, 2] of (GPU block, host block), one CTA per (pair, layer); a
// block is bs rows, which are contiguous in both the slab and the pool.
extern "C" __global__ void __launch_bounds__(COPY_THREADS)
    hisparse_copy_blocks(const int* __restrict__ pairs, int n, const u64* __restrict__ layers, int L, int bs,
                         int rb, int gpu_blocks, int host_blocks, int to_host) {
  const u64 block_bytes = (u64)bs * (u64)rb;
  const u32 chunks = (u32)(block_bytes >> 4);  // the launcher keeps a block below 2^31 bytes
  for (u32 j = blockIdx.x; j < (u32)n * (u32)L; j += gridDim.x) {
    const u32 p = j % (u32)n;
    const u32 l = j / (u32)n;
    const int gpu = pairs[2 * p];
    const int host = pairs[2 * p + 1];
    if (gpu < 0 || host < 0 || gpu >= gpu_blocks || host >= host_blocks) continue;
    uint4* g = (uint4*)(layers[l] + (u64)gpu * block_bytes);
    uint4* h = (uint4*)(layers[L + l] + (u64)host * block_bytes);
    if (to_host) {
      copy_span(g, h, chunks, threadIdx.x, blockDim.x);
    } else {
      copy_span(h, g, chunks, threadIdx.x, blockDim.x);
    }
  }
}

// replay(miss_plan, layers): copies host row to GPU row of the first count[i] pairs (clamped into 0 ..= K) of
// every batch row i's K entries of `plan`, for every layer. Each CTA lays the pairs of all batch rows end to
// end (start[i]: pairs before batch row i, prefix sums of the counts in dynamic shared memory, R + 1 ints)
// and its warps take (pair, layer) jobs from that list, so the misses of one request spread over the whole
// GPU whatever the batch size.
extern "C" __global__ void __launch_bounds__(COPY_THREADS)
    hisparse_replay(const i64* __restrict__ plan, const int* __restrict__ count, int R, int K,
                    const u64* __restrict__ layers, int L, int rb, int gpu_rows, int host_rows) {
  HS_DYNAMIC_SHARED(int, start);
  __shared__ int warp_sums[32];

  // The grid is sized for the worst case (every element a miss), and a hit-only step records no pair: then
  // every CTA leaves after one read of the counts and one barrier.
  bool any = false;
  for (int i = threadIdx.x; i < R; i += blockDim.x) any |= count[i] > 0 && K > 0;
  if (!__syncthreads_or(any)) return;

  int all = 0;
  for (int i0 = 0; i0 < R; i0 += blockDim.x) {
    const int i = i0 + threadIdx.x;
    const int c = i < R ? min(max(count[i], 0), K) : 0;
    int total;
    const int s = all + block_exclusive_scan(c, &total, warp_sums);
    if (i < R) start[i] = s;
    all += total;
  }
  __syncthreads();  // start[] is complete

  const u32 lane = threadIdx.x & 31;
  const u32 nv = (u32)rb >> 4;
  const u32 pairs = (u32)all;  // <= R * K, which the launcher keeps (times L) below 2^31
  for (u32 j = warp_index(); j < pairs * (u32)L; j += warp_count()) {
    const u32 e = j % pairs;
    const u32 l = j / pairs;
    // The batch row of pair e: the last i with start[i] <= e (a row without pairs shares its start with the
    // next row, so the last such i is the one that holds e).
    int lo = 0;
    int hi = R - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if ((u32)start[mid] <= e) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const i64* pair = plan + 2 * ((u64)lo * (u32)K + (e - (u32)start[lo]));
    const i64 gpu = pair[0];
    const i64 host = pair[1];
    if (gpu < 0 || host < 0 || gpu >= gpu_rows || host >= host_rows) continue;
    copy_span((const uint4*)(layers[L + l] + (u64)host * rb), (uint4*)(layers[l] + (u64)gpu * rb), nv, lane, 32);
  }
}
