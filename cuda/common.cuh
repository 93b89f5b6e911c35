// Shared helpers of the hisparse kernels. NVRTC compiles these files without the CUDA toolkit headers,
// so only compiler builtins are used (uint4, atomics, warp shuffles).
#pragma once

typedef unsigned char u8;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define HS_FULL_MASK 0xffffffffu

// Exclusive prefix sum of `v` over the block, in thread order; `*total` receives the block's sum.
// Every thread of the block must call it. It begins with a barrier-free warp scan and contains
// __syncthreads(), so reads that a caller makes before the call are complete, block-wide, when the
// call returns: callers rely on this to rewrite arrays in place. `warp_sums` is 32 ints of shared memory.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total, int* warp_sums) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int nwarps = (blockDim.x + 31) >> 5;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(HS_FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(HS_FULL_MASK, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  const int prefix = (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
  *total = warp_sums[31];
  __syncthreads();  // warp_sums is reused by the next call
  return prefix;
}

// Copies 16-byte chunks q in [first, total) with step `stride`; addr(q, &src, &dst) locates chunk q and
// returns false to skip it. Four loads are issued before their stores so that reads of pinned host memory
// over PCIe (hundreds of cycles each) overlap instead of running one round trip at a time.
template <class Addr>
__device__ __forceinline__ void copy_chunks(i64 total, i64 first, i64 stride, Addr addr) {
  for (i64 q0 = first; q0 < total; q0 += 4 * stride) {
    uint4 v[4];
    uint4* dst[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const i64 q = q0 + u * stride;
      const uint4* src;
      if (q < total && addr(q, &src, &dst[u])) {
        v[u] = *src;
      } else {
        dst[u] = nullptr;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      if (dst[u] != nullptr) *dst[u] = v[u];
    }
  }
}
