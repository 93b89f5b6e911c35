// Kernels that test the harness itself (tests/test_kernel_harness.py): what it must compute, and the misuse it
// must report. Not part of hisparse; compiled only into the harness's self-test library.
#include "common.cuh"

// out[t] = every warp intrinsic the shim provides, combined, for thread t; a block scan as well.
extern "C" __global__ void selftest_intrinsics(int* out) {
  __shared__ int warp_sums[32];
  const int t = threadIdx.x;
  const int lane = t & 31;
  int total;
  const int prefix = block_exclusive_scan(t % 3, &total, warp_sums);
  const unsigned ballot = __ballot_sync(HS_FULL_MASK, lane % 5 == 0);
  const unsigned peers = __match_any_sync(HS_FULL_MASK, lane / 4);
  const int up = __shfl_up_sync(HS_FULL_MASK, t, 3);
  const int down = __shfl_down_sync(HS_FULL_MASK, t, 2);
  const int idx = __shfl_sync(HS_FULL_MASK, t, 7);
  const int x = __shfl_xor_sync(HS_FULL_MASK, t, 5);
  const int any = __syncthreads_or(t == 77);
  out[8 * t + 0] = prefix;
  out[8 * t + 1] = total;
  out[8 * t + 2] = (int)ballot;
  out[8 * t + 3] = (int)peers;
  out[8 * t + 4] = up;
  out[8 * t + 5] = down;
  out[8 * t + 6] = idx * 1000 + x;
  out[8 * t + 7] = any;
}

// A write past the end of `out` (n ints).
extern "C" __global__ void selftest_out_of_bounds(int* out, int n) {
  if (threadIdx.x == 0) out[n] = 1;
}

// Half the block waits at one barrier, half at another.
extern "C" __global__ void selftest_divergent_barrier(int* out) {
  if (threadIdx.x < blockDim.x / 2) {
    __syncthreads();
  } else {
    __syncthreads();
  }
  out[threadIdx.x] = 1;
}

// Thread 0 leaves before a barrier the others wait at.
extern "C" __global__ void selftest_exit_before_barrier(int* out) {
  if (threadIdx.x == 0) return;
  __syncthreads();
  out[threadIdx.x] = 1;
}

// Lane 0 of warp 0 skips a shuffle the rest of its warp makes.
extern "C" __global__ void selftest_missing_lane(int* out) {
  int v = threadIdx.x;
  if (threadIdx.x != 0) v = __shfl_down_sync(HS_FULL_MASK, v, 1);
  __syncthreads();
  out[threadIdx.x] = v;
}

// Every thread writes its slot of shared memory and reads its neighbour's. With `barrier` 0 the read may come
// before the neighbour's write: the harness must make that visible.
extern "C" __global__ void selftest_neighbour(int* out, int barrier) {
  HS_DYNAMIC_SHARED(int, slots);
  slots[threadIdx.x] = (int)threadIdx.x;
  if (barrier) __syncthreads();
  out[threadIdx.x] = slots[(threadIdx.x + 1) % blockDim.x];
}

// block_exclusive_scan without its last barrier, twice in a row: only a warp that runs ahead of the others
// through the second scan's shuffles overwrites a warp total that a slow warp has yet to read from the first.
__device__ int scan_without_last_barrier(int v, int* total, int* warp_sums) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  int x = v;
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(HS_FULL_MASK, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    int s = lane < (int)(blockDim.x >> 5) ? warp_sums[lane] : 0;
    for (int o = 1; o < 32; o <<= 1) {
      const int y = __shfl_up_sync(HS_FULL_MASK, s, o);
      if (lane >= o) s += y;
    }
    warp_sums[lane] = s;
  }
  __syncthreads();
  *total = warp_sums[31];
  return (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
}

extern "C" __global__ void selftest_scan_twice(int* out) {
  __shared__ int warp_sums[32];
  int total;
  const int a = scan_without_last_barrier(1, &total, warp_sums);
  const int b = scan_without_last_barrier(2, &total, warp_sums);
  out[threadIdx.x] = a * 10000 + b;
}

// Every thread adds 1 to out[0] (mode 0: atomicAdd; 1: a plain +=, a lost-update race; 2: atomicAdd, then, after
// a barrier, thread 0 reads the sum: no race) and writes out[1 + its index] (its own word: never a race).
extern "C" __global__ void selftest_global_add(int* out, int mode) {
  if (mode == 1) {
    out[0] += 1;
  } else {
    atomicAdd(&out[0], 1);
  }
  out[1 + threadIdx.x] = (int)threadIdx.x;
  __syncthreads();
  if (mode == 2 && threadIdx.x == 0) out[1] = out[0];
}
