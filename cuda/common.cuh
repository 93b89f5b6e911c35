// Shared helpers of the hisparse kernels. NVRTC compiles these files without the CUDA toolkit headers,
// so only compiler builtins are used (uint4, atomics, warp intrinsics). The CPU kernel harness
// (tests/kernel_harness/) compiles the same files as C++ and defines HS_DYNAMIC_SHARED itself; nothing
// else here knows about it.
#pragma once

typedef unsigned char u8;
typedef unsigned int u32;
typedef long long i64;
typedef unsigned long long u64;

#define HS_FULL_MASK 0xffffffffu
#define HS_NONE 0xffffffffu  // "no slot", "no index" in u32 fields

// Status bits of SPEC.md.
#define HS_OVERFLOW 1
#define HS_NO_HOST_COPY 2
#define HS_BAD_TABLE 4
#define HS_BAD_HOT 8

// The kernel's dynamic shared memory as a `type` array called `name`.
#ifndef HS_DYNAMIC_SHARED
#define HS_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif

// Exclusive prefix sum of `v` over the block, in thread order; `*total` receives the block's sum.
// Every thread of the block must call it. It begins with a barrier-free warp scan and contains
// __syncthreads(), so reads that a caller makes before the call are complete, block-wide, when the
// call returns: callers rely on this to rewrite arrays in place. `warp_sums` is 32 ints of shared memory.
// With `reuse` false the last barrier, which lets the next call write warp_sums, is left out: the caller
// passes a barrier of its own before warp_sums is used again.
__device__ __forceinline__ int block_exclusive_scan(int v, int* total, int* warp_sums, bool reuse = true) {
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
  if (reuse) __syncthreads();  // warp_sums is reused by the next call
  return prefix;
}

// Items a thread holds in registers in the run helpers below: a block-wide pass over n items takes
// ceil(n / (HS_RUN * blockDim)) rounds, so a hot region of 10,240 slots takes 2 rounds of 1024 threads, not 10.
#define HS_RUN 8

// Calls f(k, src[k]) for every k in [0, count), strided over the block. Each thread issues RUN loads before
// it uses any, so that their latencies overlap (an atomic in f would otherwise keep the compiler from
// hoisting the next load above it). f may write src[k] (only its own k: every load of a round precedes it).
template <int RUN = HS_RUN, class F>
__device__ __forceinline__ void for_each_loaded(const int* src, int count, F f) {
  for (int k0 = threadIdx.x; k0 < count; k0 += RUN * blockDim.x) {
    int v[RUN];
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
      const int k = k0 + u * (int)blockDim.x;
      if (k < count) v[u] = src[k];
    }
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
      const int k = k0 + u * (int)blockDim.x;
      if (k < count) f(k, v[u]);
    }
  }
}

// Visits the items [0, count) in order, each thread a run of RUN consecutive items per round: load(k)
// reads item k, keep(v) says whether it counts, and visit(k, v, kept, rank) sees every item, with rank = the
// number of kept items before it. Returns the number of kept items. Every thread of the block must call it.
// A round reads all its items before its scan's barrier and visits them after it, so visit may write items
// in place at an index no larger than its own (rank <= k), over its own round or earlier ones.
// RUN (at most 32) defaults to HS_RUN items, fewer for wide items where registers are short. With `reuse`
// false the last round's scan leaves out its last barrier (block_exclusive_scan).
template <class T, int RUN = HS_RUN, class Load, class Keep, class Visit>
__device__ __forceinline__ int block_runs(int count, Load load, Keep keep, Visit visit, int* warp_sums,
                                          bool reuse = true) {
  int base = 0;
  for (int r0 = 0; r0 < count; r0 += RUN * (int)blockDim.x) {
    const int k0 = r0 + (int)threadIdx.x * RUN;
    T v[RUN];
    u32 kept = 0;  // bit u: item k0 + u counts
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
      if (k0 + u < count) {
        v[u] = load(k0 + u);
        if (keep(v[u])) kept |= 1u << u;
      }
    }
    int total;
    const bool last = r0 + RUN * (int)blockDim.x >= count;
    int rank = base + block_exclusive_scan(__popc(kept), &total, warp_sums, reuse || !last);
#pragma unroll
    for (int u = 0; u < RUN; ++u) {
      if (k0 + u < count) {
        const bool k = (kept >> u) & 1;
        visit(k0 + u, v[u], k, rank);
        rank += k;
      }
    }
    base += total;
  }
  return base;
}

// Copies `chunks` 16-byte chunks from src to dst; this thread takes chunks lane, lane + lanes, ...
// Four loads are issued before their stores so that reads of pinned host memory over PCIe (hundreds of
// cycles each) overlap instead of running one round trip at a time. Offsets are 32-bit: callers compute
// the 64-bit base of a row or block once.
__device__ __forceinline__ void copy_span(const uint4* __restrict__ src, uint4* __restrict__ dst, u32 chunks,
                                          u32 lane, u32 lanes) {
  for (u32 c0 = lane; c0 < chunks; c0 += 4 * lanes) {
    uint4 v[4];
#pragma unroll
    for (u32 u = 0; u < 4; ++u) {
      const u32 c = c0 + u * lanes;
      if (c < chunks) v[u] = src[c];
    }
#pragma unroll
    for (u32 u = 0; u < 4; ++u) {
      const u32 c = c0 + u * lanes;
      if (c < chunks) dst[c] = v[u];
    }
  }
}
