// gather, copy_rows, copy_blocks and replay of cuda/SPEC.md: kernels that move rows and touch no state.
// `layers` holds 2 * L addresses: the GPU slabs of the L layers, then their host pools (pinned memory,
// read and written in place through unified addressing). Grids are sized by the launcher and every
// kernel strides over its work, so any grid is correct.
#include "common.cuh"

// dense[i, j, :] = slab[row_ids[i, j]], zeros where the row id is negative; n = R * K elements.
extern "C" __global__ void __launch_bounds__(256)
    hisparse_gather(const int* __restrict__ row_ids, const u8* __restrict__ slab, u8* __restrict__ dense,
                    i64 n, int rb) {
  const int nv = rb >> 4;
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 q = (i64)blockIdx.x * blockDim.x + threadIdx.x; q < n * nv; q += stride) {
    const int row = row_ids[q / nv];
    uint4 v = {0u, 0u, 0u, 0u};
    if (row >= 0) v = ((const uint4*)(slab + (i64)row * rb))[q % nv];
    ((uint4*)dense)[q] = v;
  }
}

// For each of the n pairs (GPU unit, host unit) and each layer, copies unit_bytes bytes starting at
// unit * unit_bytes, host to device or device to host. Pairs with a negative entry are padding.
template <class T>
__device__ __forceinline__ void copy_pairs(const T* pairs, i64 n, const u64* layers, int L, i64 unit_bytes,
                                           bool to_host) {
  const i64 nv = unit_bytes >> 4;
  copy_chunks(L * n * nv, (i64)blockIdx.x * blockDim.x + threadIdx.x, (i64)gridDim.x * blockDim.x,
              [&](i64 q, const uint4** src, uint4** dst) {
                const i64 c = q % nv;
                const i64 job = q / nv;
                const i64 p = job % n;
                const int l = (int)(job / n);
                const i64 gpu_unit = pairs[2 * p];
                const i64 host_unit = pairs[2 * p + 1];
                if (gpu_unit < 0 || host_unit < 0) return false;
                uint4* gpu = (uint4*)(layers[l] + gpu_unit * unit_bytes) + c;
                uint4* host = (uint4*)(layers[L + l] + host_unit * unit_bytes) + c;
                *src = to_host ? gpu : host;
                *dst = to_host ? host : gpu;
                return true;
              });
}

// copy_rows(pairs, direction): pairs int64 [n, 2] of (GPU row, host row).
extern "C" __global__ void __launch_bounds__(256)
    hisparse_copy_rows(const i64* __restrict__ pairs, i64 n, const u64* __restrict__ layers, int L, int rb,
                       int to_host) {
  copy_pairs(pairs, n, layers, L, (i64)rb, to_host != 0);
}

// copy_blocks(pairs, direction): pairs int32 [n, 2] of (GPU block, host block); a block is bs rows, which
// are contiguous in both the slab and the pool.
extern "C" __global__ void __launch_bounds__(256)
    hisparse_copy_blocks(const int* __restrict__ pairs, i64 n, const u64* __restrict__ layers, int L, int bs,
                         int rb, int to_host) {
  copy_pairs(pairs, n, layers, L, (i64)bs * rb, to_host != 0);
}

// replay(miss_plan, layers): repeats, for other layers, the miss copies of a resolve call that wrote
// miss_plan int64 [R * K, 2] and miss_count int32 [R] (pairs (GPU row, host row), miss_count[i] of them at
// the start of batch row i's K entries). grid = (R, L): CTA (i, l) copies batch row i's pairs for layer l.
extern "C" __global__ void __launch_bounds__(256)
    hisparse_replay(const i64* __restrict__ miss_plan, const int* __restrict__ miss_count, int K,
                    const u64* __restrict__ layers, int L, int rb) {
  const int i = blockIdx.x;
  const int l = blockIdx.y;
  const int nv = rb >> 4;
  const i64* pairs = miss_plan + (i64)i * K * 2;
  copy_chunks((i64)miss_count[i] * nv, threadIdx.x, blockDim.x, [&](i64 q, const uint4** src, uint4** dst) {
    const i64 m = q / nv;
    const int c = (int)(q % nv);
    *src = (const uint4*)(layers[L + l] + pairs[2 * m + 1] * rb) + c;
    *dst = (uint4*)(layers[l] + pairs[2 * m] * rb) + c;
    return true;
  });
}
