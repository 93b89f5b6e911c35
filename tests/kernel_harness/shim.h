// CUDA device code as C++ on the CPU: the part of CUDA the hisparse kernels use, for the CPU kernel harness.
// The harness compiles every cuda/*.cu file unchanged with this header forced in first (g++ -include).
//
// Each CUDA thread is a fiber; runtime.cpp runs the fibers of one CTA at a time (CTAs in random order), in a
// random order between barriers, with random preemption at atomics, and checks what CUDA leaves undefined:
// barriers reached by only some threads or at different places, warp collectives missing a lane. Shared
// memory, static and dynamic, is filled with garbage before each CTA. __shared__ variables become statics in
// one ELF section, which the runtime refills: CTAs never overlap, so one copy serves them all.
//
// Global memory (the harness's guarded buffers) is watched through the compiler: the kernel sources are built
// with g++'s -fsanitize=thread instrumentation, whose hooks (__tsan_read4 and the like, one call per load and
// store) the runtime defines itself, without the sanitizer's library. They count each CTA's global bytes and
// find data races on global memory between two barriers (see runtime.cpp); the atomics below are not
// instrumented and report themselves as atomic instead.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <type_traits>
#include <utility>

#define __global__
#define __device__ inline
#define __host__
#define __forceinline__
#define __noinline__
#define __launch_bounds__(...)
#define __restrict__ __restrict
#define __shared__ static __attribute__((section("hs_shared")))
#define HS_DYNAMIC_SHARED(type, name) type* const name = static_cast<type*>(hs::dynamic_shared())

struct uint4 {
  unsigned x, y, z, w;
};

struct hs_dim3 {
  unsigned x, y, z;
};

namespace hs {

struct Thread {
  hs_dim3 thread_idx;
};

extern Thread* current;  // the fiber running now
extern hs_dim3 block_idx, block_dim, grid_dim;

// Where a barrier or warp collective is called from: threads that meet must come from one place.
struct Site {
  const char* file;
  int line;
};

void* dynamic_shared();
int barrier(int predicate, Site site);  // returns whether any thread's predicate was non-zero
void preempt_point();
// An atomic read-modify-write of `bytes` at `p` by the running thread (counted; never a race with another).
void atomic_access(const void* p, size_t bytes);

enum WarpOp { SHFL_UP, SHFL_DOWN, SHFL_IDX, SHFL_XOR, BALLOT, MATCH_ANY, ANY, ALL, SYNC };
// A warp collective: every lane of `mask` calls it with its value; returns this lane's result.
uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width, Site site);

template <class T>
uint64_t bits_of(T v) {
  static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "warp values are at most 8 bytes");
  uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}

template <class T>
T from_bits(uint64_t b) {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}

// Kernels are called like cuLaunchKernel calls them: args[i] points at parameter i's value.
using Trampoline = void (*)(void**);
void register_kernel(const char* name, Trampoline trampoline);

template <class... A, size_t... I>
void call_kernel(void (*kernel)(A...), void** args, std::index_sequence<I...>) {
  kernel(*static_cast<A*>(args[I])...);
}

template <class... A>
void call_kernel(void (*kernel)(A...), void** args) {
  call_kernel(kernel, args, std::index_sequence_for<A...>{});
}

template <class T>
struct same {
  using type = T;
};

// The types CUDA's atomic functions take.
template <class T>
constexpr bool atomic_type = std::is_same<T, int>::value || std::is_same<T, unsigned>::value ||
                             std::is_same<T, unsigned long long>::value;

}  // namespace hs

// Makes `kernel` callable by name through the runtime's C API.
#define HS_REGISTER(kernel)                                                                                 \
  static const int hs_registered_##kernel =                                                                 \
      (hs::register_kernel(#kernel, [](void** args) { hs::call_kernel(kernel, args); }), 0);

#define threadIdx (hs::current->thread_idx)
#define blockIdx (hs::block_idx)
#define blockDim (hs::block_dim)
#define gridDim (hs::grid_dim)

#define HS_SITE int line = __builtin_LINE(), const char* file = __builtin_FILE()
#define HS_HERE hs::Site{file, line}

inline void __syncthreads(HS_SITE) { hs::barrier(0, HS_HERE); }
inline int __syncthreads_or(int predicate, HS_SITE) { return hs::barrier(predicate != 0, HS_HERE); }
inline void __syncwarp(unsigned mask = 0xffffffffu, HS_SITE) {
  hs::warp_collective(hs::SYNC, mask, 0, 0, 32, HS_HERE);
}

using std::max;
using std::min;

#define HS_SHFL(name, op)                                                                                   \
  template <class T>                                                                                        \
  T name(unsigned mask, T v, int arg, int width = 32, HS_SITE) {                                            \
    return hs::from_bits<T>(hs::warp_collective(hs::op, mask, hs::bits_of(v), arg, width, HS_HERE));        \
  }
HS_SHFL(__shfl_up_sync, SHFL_UP)
HS_SHFL(__shfl_down_sync, SHFL_DOWN)
HS_SHFL(__shfl_sync, SHFL_IDX)
HS_SHFL(__shfl_xor_sync, SHFL_XOR)
#undef HS_SHFL

inline unsigned __ballot_sync(unsigned mask, int predicate, HS_SITE) {
  return (unsigned)hs::warp_collective(hs::BALLOT, mask, predicate != 0, 0, 32, HS_HERE);
}
inline int __any_sync(unsigned mask, int predicate, HS_SITE) {
  return (int)hs::warp_collective(hs::ANY, mask, predicate != 0, 0, 32, HS_HERE);
}
inline int __all_sync(unsigned mask, int predicate, HS_SITE) {
  return (int)hs::warp_collective(hs::ALL, mask, predicate != 0, 0, 32, HS_HERE);
}
template <class T>
unsigned __match_any_sync(unsigned mask, T v, HS_SITE) {
  return (unsigned)hs::warp_collective(hs::MATCH_ANY, mask, hs::bits_of(v), 0, 32, HS_HERE);
}

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll((unsigned long long)x); }
inline unsigned __umulhi(unsigned a, unsigned b) { return (unsigned)(((unsigned long long)a * b) >> 32); }
inline void __threadfence() { hs::preempt_point(); }
inline void __threadfence_block() { hs::preempt_point(); }

// Atomics: the fibers never run at once, so a plain read-modify-write is atomic; the preemption point before
// it lets another thread run first, as on a GPU. Not instrumented (HS_ATOMIC_BODY): they tell the runtime
// they are atomic instead.
#define HS_ATOMIC_BODY __attribute__((no_sanitize("thread"), noinline))
#define HS_ATOMIC(name, expr)                                                                               \
  template <class T>                                                                                        \
  HS_ATOMIC_BODY T name(T* p, typename hs::same<T>::type v) {                                               \
    static_assert(hs::atomic_type<T>, "CUDA has no " #name " for this type");                              \
    hs::preempt_point();                                                                                    \
    hs::atomic_access(p, sizeof(T));                                                                        \
    const T old = *p;                                                                                       \
    *p = (expr);                                                                                            \
    return old;                                                                                             \
  }
HS_ATOMIC(atomicAdd, old + v)
HS_ATOMIC(atomicSub, old - v)
HS_ATOMIC(atomicMin, old < v ? old : v)
HS_ATOMIC(atomicMax, old > v ? old : v)
HS_ATOMIC(atomicOr, old | v)
HS_ATOMIC(atomicAnd, old & v)
HS_ATOMIC(atomicXor, old ^ v)
HS_ATOMIC(atomicExch, v)
#undef HS_ATOMIC

template <class T>
HS_ATOMIC_BODY T atomicCAS(T* p, typename hs::same<T>::type compare, typename hs::same<T>::type value) {
  static_assert(hs::atomic_type<T>, "CUDA has no atomicCAS for this type");
  hs::preempt_point();
  hs::atomic_access(p, sizeof(T));
  const T old = *p;
  if (old == compare) *p = value;
  return old;
}
