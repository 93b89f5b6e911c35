// The runtime of the CPU kernel harness (see shim.h): fibers for CUDA threads, a randomized scheduler, checked
// barriers and warp collectives, guarded buffers, and a C API that Python drives with ctypes.
//
// A launch runs its CTAs one after another in a random order. Within a CTA every thread is a fiber that runs
// until it reaches a barrier or a warp collective, finishes, or is preempted (at an atomic, with a probability
// the caller sets); the scheduler then resumes a runnable fiber. So between two barriers the threads' work
// interleaves in a different order on every run, which is what exposes a missing __syncthreads: a thread reads
// shared memory before the thread that should have written it ran, and gets garbage. Each barrier interval
// draws one of three policies: uniform (any runnable fiber), thread priorities, or warp priorities (random
// keys: the highest runnable runs). Priorities let one thread or warp run far ahead of the others, through many
// warp collectives, which uniform picks almost never do; a preemption then draws the thread a new priority.
//
// Global memory: every load and store the kernel sources make goes through a hook below (g++'s ThreadSanitizer
// instrumentation, -fsanitize=thread, with this file's own __tsan_* functions in place of the sanitizer's
// library), and the atomics of shim.h report themselves. An access that lands in a guarded buffer (hs_alloc:
// what the kernels see as global memory; never shared memory, stacks or kernel arguments) is counted for its
// CTA (bytes read, bytes written; an atomic counts as both) and checked for a data race: two threads of a CTA
// touching one 4-byte word of global memory between two of its barriers, or two CTAs of one launch touching it at
// all, one of them writing, not both by atomics. That is what a plain `x += v` in place of an atomicAdd does (a
// read and a write that another thread's can fall between), and what a missing barrier between a write and
// another thread's read of global memory does; the fiber schedule need not interleave them for the check to see
// it. Accesses within a warp count as two threads' (the kernels rely on no warp-synchronous memory order).
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <algorithm>
#include <map>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "shim.h"

namespace hs {

Thread* current = nullptr;
hs_dim3 block_idx, block_dim, grid_dim;

namespace {

// ---------------------------------------------------------------------------------------------- switching

#if defined(__x86_64__)
extern "C" void hs_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl hs_switch
  .hidden hs_switch
  .type hs_switch, @function
hs_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size hs_switch, .-hs_switch
)");
constexpr int kSavedWords = 6;  // callee-saved registers below the return address
#elif defined(__aarch64__)
extern "C" void hs_switch(void** save_sp, void* load_sp);
asm(R"(
  .text
  .globl hs_switch
  .hidden hs_switch
  .type hs_switch, %function
hs_switch:
  sub sp, sp, #160
  stp x19, x20, [sp, #0]
  stp x21, x22, [sp, #16]
  stp x23, x24, [sp, #32]
  stp x25, x26, [sp, #48]
  stp x27, x28, [sp, #64]
  stp x29, x30, [sp, #80]
  stp d8, d9, [sp, #96]
  stp d10, d11, [sp, #112]
  stp d12, d13, [sp, #128]
  stp d14, d15, [sp, #144]
  mov x2, sp
  str x2, [x0]
  mov sp, x1
  ldp x19, x20, [sp, #0]
  ldp x21, x22, [sp, #16]
  ldp x23, x24, [sp, #32]
  ldp x25, x26, [sp, #48]
  ldp x27, x28, [sp, #64]
  ldp x29, x30, [sp, #80]
  ldp d8, d9, [sp, #96]
  ldp d10, d11, [sp, #112]
  ldp d12, d13, [sp, #128]
  ldp d14, d15, [sp, #144]
  add sp, sp, #160
  ret
  .size hs_switch, .-hs_switch
)");
#else
#error "the kernel harness switches fibers on x86-64 and aarch64 only"
#endif

constexpr size_t kStackBytes = 128 * 1024;
constexpr size_t kPage = 4096;

enum State { READY, AT_BARRIER, AT_WARP, DONE };

struct Fiber {
  Thread thread;
  void* sp = nullptr;
  char* stack = nullptr;  // lowest usable address; a guard page lies below
  State state = DONE;
  int predicate = 0;     // the barrier's predicate
  uint64_t result = 0;   // what the barrier or collective returned
  Site site{nullptr, 0};
};

struct Warp {
  int arrived = 0;
  unsigned mask = 0;
  unsigned present = 0;
  WarpOp op = SYNC;
  Site site{nullptr, 0};
  int width = 32;
  uint64_t value[32];
  int arg[32];
};

struct Launch {
  Trampoline kernel = nullptr;
  void** args = nullptr;
};

std::map<std::string, Trampoline>& registry() {
  static std::map<std::string, Trampoline> kernels;
  return kernels;
}

std::vector<Fiber> fibers;
std::vector<Warp> warps;

enum Policy { UNIFORM, THREAD_PRIORITY, WARP_PRIORITY };

uint64_t next_random();

// The runnable fibers, taken in the order of the interval's policy.
struct Ready {
  Policy policy = UNIFORM;
  std::vector<uint64_t> priority;  // by fiber
  std::vector<int> items;          // a max-heap on priority unless the policy is uniform

  bool higher(int a, int b) const { return priority[a] < priority[b]; }
  bool empty() const { return items.empty(); }
  void clear() { items.clear(); }
  void push(int i) {
    items.push_back(i);
    if (policy != UNIFORM) std::push_heap(items.begin(), items.end(), [this](int a, int b) { return higher(a, b); });
  }
  int pop() {
    if (policy == UNIFORM) {
      const size_t k = next_random() % items.size();
      const int i = items[k];
      items[k] = items.back();
      items.pop_back();
      return i;
    }
    std::pop_heap(items.begin(), items.end(), [this](int a, int b) { return higher(a, b); });
    const int i = items.back();
    items.pop_back();
    return i;
  }
  // A new interval (nothing runnable): a new policy and new priorities for `n` threads.
  void redraw(int n) {
    policy = static_cast<Policy>(next_random() % 3);
    priority.resize(n);
    uint64_t warp_key = 0;
    for (int i = 0; i < n; ++i) {
      if (i % 32 == 0) warp_key = next_random() << 32;
      priority[i] = policy == WARP_PRIORITY ? warp_key | (next_random() >> 32) : next_random();
    }
  }
};
Ready ready;
int running = -1;
void* scheduler_sp = nullptr;
Launch launch_now;
char* smem = nullptr;  // dynamic shared memory, its end at a guard page
uint64_t rng = 1;
double preempt_probability = 0.0;
std::string error;
bool failed = false;
uint64_t stats[4];  // switches, barriers, collectives, preemptions

// ---------------------------------------------------------------------------------------------- global memory

struct Range {
  uintptr_t lo, hi;
};
std::vector<Range> global_ranges;  // the data of every guarded buffer, sorted and disjoint
size_t last_range = 0;              // where the last lookup landed: accesses come in runs

// What one CTA of a launch did: barriers executed (once per barrier, not per thread) and global memory moved.
struct CtaCount {
  uint64_t x, y, barriers, read_bytes, written_bytes, atomics, read_words, written_words;
};
std::vector<CtaCount> cta_counts;  // of the current (or last) launch, in the order the CTAs ran
bool in_cta = false;
// With footprints on, read_words and written_words count the distinct 4-byte words of global memory the CTA
// read and wrote (an atomic's word in both): the bytes it would move if every re-read hit a cache.
bool track_footprint = false;
std::unordered_set<uintptr_t> read_set, written_set;

// Accesses to one 4-byte word of global memory since the CTA's last barrier.
struct Shadow {
  int writer = -1;  // the first thread that wrote it (or made an atomic), -1 when none
  int reader = -1;  // the first that read it (or made an atomic)
  bool many_writers = false, many_readers = false;
  bool plain_write = false, plain_read = false;  // some write (read) was not an atomic
};
std::unordered_map<uintptr_t, Shadow> shadow;
// The same for the whole launch, by CTA: CTAs of one launch never synchronize with each other.
std::unordered_map<uintptr_t, Shadow> launch_shadow;
int cta_index = -1;  // the running CTA's index in the launch's order
bool check_races = true;

// Records an access of `who` to the word `s` describes; returns the other party when it races with an earlier
// access (two parties, one writing, not both atomic), else -1.
int record(Shadow& s, int who, bool write, bool atomic) {
  const bool other_writer = s.writer >= 0 && (s.writer != who || s.many_writers);
  const bool other_reader = s.reader >= 0 && (s.reader != who || s.many_readers);
  bool race;
  if (atomic) {
    race = (other_writer && s.plain_write) || (other_reader && s.plain_read);
  } else if (write) {
    race = other_writer || other_reader;
  } else {
    race = other_writer;
  }
  if (race) return other_writer && s.writer != who ? s.writer : s.reader != who ? s.reader : s.writer;
  if (write || atomic) {
    if (s.writer < 0) s.writer = who; else if (s.writer != who) s.many_writers = true;
    s.plain_write |= !atomic;
  }
  if (!write || atomic) {
    if (s.reader < 0) s.reader = who; else if (s.reader != who) s.many_readers = true;
    s.plain_read |= !atomic;
  }
  return -1;
}

const char* code_at(const void* pc, char* buf, size_t n) {
  Dl_info info;
  if (pc != nullptr && dladdr(pc, &info) && info.dli_sname != nullptr) {
    snprintf(buf, n, "%s+0x%zx", info.dli_sname, (size_t)((const char*)pc - (const char*)info.dli_saddr));
  } else {
    snprintf(buf, n, "%p", pc);
  }
  return buf;
}

const Range* global_range(uintptr_t a) {
  if (last_range < global_ranges.size() && a - global_ranges[last_range].lo < global_ranges[last_range].hi -
                                                                               global_ranges[last_range].lo) {
    return &global_ranges[last_range];
  }
  auto it = std::upper_bound(global_ranges.begin(), global_ranges.end(), a,
                             [](uintptr_t v, const Range& r) { return v < r.lo; });
  if (it == global_ranges.begin()) return nullptr;
  --it;
  if (a >= it->hi) return nullptr;
  last_range = static_cast<size_t>(it - global_ranges.begin());
  return &*it;
}

uint64_t next_random() {  // xorshift64*
  rng ^= rng >> 12;
  rng ^= rng << 25;
  rng ^= rng >> 27;
  return rng * 2685821657736338717ull;
}

void fail(const char* fmt, ...) {
  if (failed) return;
  char buf[512];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, sizeof buf, fmt, ap);
  va_end(ap);
  error = buf;
  failed = true;
}

// A load (write = false), store or atomic (both) of `bytes` at `p` by the running thread, from code at `pc`.
void global_access(const void* p, size_t bytes, bool write, bool atomic, const void* pc) {
  if (!in_cta || running < 0 || failed || bytes == 0) return;
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  const Range* range = global_range(a);
  if (range == nullptr) return;
  CtaCount& c = cta_counts.back();
  if (atomic) {
    c.read_bytes += bytes;
    c.written_bytes += bytes;
    ++c.atomics;
  } else {
    (write ? c.written_bytes : c.read_bytes) += bytes;
  }
  if (track_footprint) {
    for (uintptr_t w = a >> 2; w <= (a + bytes - 1) >> 2; ++w) {
      if (!write || atomic) c.read_words += read_set.insert(w).second;
      if (write || atomic) c.written_words += written_set.insert(w).second;
    }
  }
  if (!check_races) return;
  const char* what = atomic ? "makes an atomic on" : write ? "writes" : "reads";
  char where[256];
  for (uintptr_t w = a >> 2; w <= (a + bytes - 1) >> 2; ++w) {
    const int other = record(shadow[w], running, write, atomic);
    if (other >= 0) {
      fail("data race on global memory: thread %d %s byte %zu of a %zu-byte buffer that thread %d touched since the "
           "last barrier (CTA %u, %u; code %s): a read-modify-write that is not atomic, or a missing barrier",
           running, what, (size_t)(a - range->lo), (size_t)(range->hi - range->lo), other, block_idx.x,
           block_idx.y, code_at(pc, where, sizeof where));
      return;
    }
    const int other_cta = record(launch_shadow[w], cta_index, write, atomic);
    if (other_cta >= 0) {
      fail("data race on global memory: CTA (%u, %u) %s byte %zu of a %zu-byte buffer that another CTA of the "
           "launch touched (code %s): CTAs of one launch never wait for each other, so only atomics may share a "
           "word that one of them writes", block_idx.x, block_idx.y, what, (size_t)(a - range->lo),
           (size_t)(range->hi - range->lo), code_at(pc, where, sizeof where));
      return;
    }
  }
}

bool same_site(Site a, Site b) { return a.line == b.line && std::strcmp(a.file, b.file) == 0; }

const char* base_name(const char* path) {
  const char* slash = std::strrchr(path, '/');
  return slash ? slash + 1 : path;
}

// Leaves the running fiber (its state already set) for the scheduler.
void to_scheduler() {
  Fiber& f = fibers[running];
  ++stats[0];
  hs_switch(&f.sp, scheduler_sp);
}

[[noreturn]] void fiber_main() {
  launch_now.kernel(launch_now.args);
  fibers[running].state = DONE;
  to_scheduler();
  __builtin_unreachable();
}

void start_fiber(Fiber& f) {
  char* top = f.stack + kStackBytes;  // 16-byte aligned
  void** sp = reinterpret_cast<void**>(top);
#if defined(__x86_64__)
  *--sp = nullptr;                                        // fiber_main's own return address: never used
  *--sp = reinterpret_cast<void*>(&fiber_main);           // hs_switch returns here
  for (int i = 0; i < kSavedWords; ++i) *--sp = nullptr;  // callee-saved registers
#else
  sp -= 20;  // the frame hs_switch pops: x19-x30, d8-d15
  for (int i = 0; i < 20; ++i) sp[i] = nullptr;
  sp[11] = reinterpret_cast<void*>(&fiber_main);  // x30: where ret goes
#endif
  f.sp = sp;
  f.state = READY;
}

void grow_fibers(size_t n) {
  while (fibers.size() < n) {
    Fiber f;
    char* region = static_cast<char*>(mmap(nullptr, kStackBytes + kPage, PROT_READ | PROT_WRITE,
                                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0));
    if (region == MAP_FAILED) {
      fail("cannot map a fiber stack");
      return;
    }
    mprotect(region, kPage, PROT_NONE);  // a stack overflow faults instead of corrupting its neighbour
    f.stack = region + kPage;
    fibers.push_back(f);
  }
}

// Fills [p, p + n) with garbage, as shared memory holds before a kernel writes it.
void garbage(void* p, size_t n) {
  auto* b = static_cast<unsigned char*>(p);
  for (size_t i = 0; i < n; ++i) b[i] = static_cast<unsigned char>(next_random() >> 56);
}

// Releases a barrier that every thread of the CTA reached, or reports what went wrong.
void release_or_report(int nthreads) {
  int live = 0, at_barrier = 0, at_warp = 0, first = -1, warp_lane = -1;
  for (int i = 0; i < nthreads; ++i) {
    if (fibers[i].state == DONE) continue;
    ++live;
    if (fibers[i].state == AT_BARRIER) {
      ++at_barrier;
      if (first < 0) first = i;
    } else if (fibers[i].state == AT_WARP && warp_lane < 0) {
      ++at_warp;
      warp_lane = i;
    }
  }
  if (live == 0) return;
  if (at_barrier == live && live == nthreads) {
    int any = 0;
    for (int i = 0; i < nthreads; ++i) {
      if (!same_site(fibers[i].site, fibers[first].site)) {
        fail("threads %d and %d wait at different barriers (%s:%d and %s:%d)", first, i,
             base_name(fibers[first].site.file), fibers[first].site.line, base_name(fibers[i].site.file),
             fibers[i].site.line);
        return;
      }
      any |= fibers[i].predicate;
    }
    ++stats[1];
    ++cta_counts.back().barriers;
    shadow.clear();  // the barrier orders every access before it
    ready.redraw(nthreads);
    for (int i = 0; i < nthreads; ++i) {
      fibers[i].result = any;
      fibers[i].state = READY;
      ready.push(i);
    }
    return;
  }
  if (at_barrier == live) {
    fail("barrier at %s:%d reached by %d threads; %d exited before it", base_name(fibers[first].site.file),
         fibers[first].site.line, live, nthreads - live);
  } else if (warp_lane >= 0) {
    const Fiber& f = fibers[warp_lane];
    fail("deadlock: thread %d waits in a warp collective at %s:%d for a lane that is at a barrier or exited",
         warp_lane, base_name(f.site.file), f.site.line);
  } else {
    fail("deadlock with %d live threads", live);
  }
}

// Runs one CTA to the end (or the first error).
void run_cta(int nthreads) {
  warps.assign((nthreads + 31) / 32, Warp());
  ready.clear();
  ready.redraw(nthreads);
  for (int i = 0; i < nthreads; ++i) {
    fibers[i].thread.thread_idx = {static_cast<unsigned>(i), 0, 0};
    start_fiber(fibers[i]);
    ready.push(i);
  }
  while (!failed) {
    if (ready.empty()) {
      release_or_report(nthreads);
      if (ready.empty()) return;  // all done, or an error
    }
    running = ready.pop();
    current = &fibers[running].thread;
    ++stats[0];
    hs_switch(&scheduler_sp, fibers[running].sp);
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------- device API

void* dynamic_shared() { return smem; }

int barrier(int predicate, Site site) {
  Fiber& f = fibers[running];
  f.predicate = predicate;
  f.site = site;
  f.state = AT_BARRIER;
  to_scheduler();
  return static_cast<int>(f.result);
}

void atomic_access(const void* p, size_t bytes) {
  global_access(p, bytes, true, true, __builtin_return_address(0));
}

void preempt_point() {
  if (preempt_probability <= 0 || (next_random() >> 11) * 0x1.0p-53 >= preempt_probability) return;
  ++stats[3];
  fibers[running].state = READY;
  ready.priority[running] = next_random();
  ready.push(running);
  to_scheduler();
}

uint64_t warp_collective(WarpOp op, unsigned mask, uint64_t value, int arg, int width, Site site) {
  const int me = running;
  const unsigned lane = static_cast<unsigned>(me) & 31;
  Warp& w = warps[me >> 5];
  if (width != 32) fail("warp collective at %s:%d with width %d: the harness takes 32", base_name(site.file),
                        site.line, width);
  if (!((mask >> lane) & 1)) fail("lane %u calls a collective at %s:%d outside its mask %08x", lane,
                                  base_name(site.file), site.line, mask);
  if (w.arrived == 0) {
    w.op = op;
    w.mask = mask;
    w.site = site;
    w.present = 0;
  } else if (w.op != op || w.mask != mask || !same_site(w.site, site)) {
    fail("warp %d diverges: collectives at %s:%d and %s:%d", me >> 5, base_name(w.site.file), w.site.line,
         base_name(site.file), site.line);
  }
  w.value[lane] = value;
  w.arg[lane] = arg;
  w.present |= 1u << lane;
  ++w.arrived;
  Fiber& f = fibers[me];
  f.site = site;
  if (w.arrived < __builtin_popcount(mask)) {
    f.state = AT_WARP;
    to_scheduler();
    return f.result;
  }
  // The last lane computes every lane's result and wakes the others.
  ++stats[2];
  const int base = me & ~31;
  for (unsigned l = 0; l < 32; ++l) {
    if (!((mask >> l) & 1)) continue;
    uint64_t r = 0;
    auto from = [&](unsigned src) -> uint64_t {
      if (!((mask >> src) & 1)) fail("lane %u reads lane %u, outside the mask, at %s:%d", l, src,
                                     base_name(site.file), site.line);
      return w.value[src];
    };
    const unsigned a = static_cast<unsigned>(w.arg[l]);
    switch (op) {
      case SHFL_UP: r = l >= a ? from(l - a) : w.value[l]; break;
      case SHFL_DOWN: r = l + a < 32 ? from(l + a) : w.value[l]; break;
      case SHFL_IDX: r = from(a & 31); break;
      case SHFL_XOR: r = from((l ^ a) & 31); break;
      case BALLOT:
      case ANY:
      case ALL: {
        unsigned ballot = 0;
        for (unsigned s = 0; s < 32; ++s) {
          if (((mask >> s) & 1) && w.value[s]) ballot |= 1u << s;
        }
        r = op == BALLOT ? ballot : op == ANY ? ballot != 0 : ballot == mask;
        break;
      }
      case MATCH_ANY: {
        unsigned peers = 0;
        for (unsigned s = 0; s < 32; ++s) {
          if (((mask >> s) & 1) && w.value[s] == w.value[l]) peers |= 1u << s;
        }
        r = peers;
        break;
      }
      case SYNC: break;
    }
    fibers[base + l].result = r;
    if (base + static_cast<int>(l) != me) {
      fibers[base + l].state = READY;
      ready.push(base + static_cast<int>(l));
    }
  }
  w.arrived = 0;
  return f.result;
}

void register_kernel(const char* name, Trampoline t) { registry()[name] = t; }

}  // namespace hs

extern "C" char __start_hs_shared[] __attribute__((weak));
extern "C" char __stop_hs_shared[] __attribute__((weak));

// ---------------------------------------------------------------------------------------------- C API

namespace {

constexpr unsigned char kCanary = 0xA5;

// A guarded buffer: [guard page][slack canary][data, 16-byte aligned][canary][guard page]; the data ends
// within 16 bytes of the upper guard page, and the slack on both sides is checked after every launch.
struct Buffer {
  char* region;
  size_t region_bytes;
  char* data;
  size_t bytes;
};
std::map<char*, Buffer> buffers;

Buffer map_guarded(size_t bytes) {
  const size_t body = (bytes + 16 + hs::kPage - 1) / hs::kPage * hs::kPage;
  const size_t total = body + 2 * hs::kPage;
  char* region = static_cast<char*>(mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
  if (region == MAP_FAILED) return {nullptr, 0, nullptr, 0};
  mprotect(region, hs::kPage, PROT_NONE);
  mprotect(region + hs::kPage + body, hs::kPage, PROT_NONE);
  char* end = region + hs::kPage + body;
  char* data = reinterpret_cast<char*>(reinterpret_cast<uintptr_t>(end - bytes) & ~uintptr_t(15));
  std::memset(region + hs::kPage, kCanary, body);
  return {region, total, data, bytes};
}

// The kernels' global memory is the data of the guarded buffers.
void ranges_changed() {
  hs::global_ranges.clear();
  for (auto& [p, b] : buffers) {
    hs::global_ranges.push_back({reinterpret_cast<uintptr_t>(b.data), reinterpret_cast<uintptr_t>(b.data + b.bytes)});
  }
  hs::last_range = 0;
}

bool intact(const Buffer& b) {
  for (char* p = b.region + hs::kPage; p < b.data; ++p) {
    if (static_cast<unsigned char>(*p) != kCanary) return false;
  }
  for (char* p = b.data + b.bytes; p < b.region + b.region_bytes - hs::kPage; ++p) {
    if (static_cast<unsigned char>(*p) != kCanary) return false;
  }
  return true;
}

}  // namespace

extern "C" {

// A zero-filled buffer of `bytes` whose neighbourhood detects stray writes (see Buffer).
void* hs_alloc(size_t bytes) {
  Buffer b = map_guarded(bytes);
  if (b.data == nullptr) return nullptr;
  std::memset(b.data, 0, bytes);
  buffers[b.data] = b;
  ranges_changed();
  return b.data;
}

void hs_free(void* p) {
  auto it = buffers.find(static_cast<char*>(p));
  if (it == buffers.end()) return;
  munmap(it->second.region, it->second.region_bytes);
  buffers.erase(it);
  ranges_changed();
}

// Number of buffers written outside their bounds (their canaries changed) since they were allocated.
int hs_damaged() {
  int n = 0;
  for (auto& [p, b] : buffers) n += !intact(b);
  return n;
}

const char* hs_error() { return hs::error.c_str(); }

// Switches, barriers, warp collectives and preemptions since the library was loaded.
void hs_stats(uint64_t* out) { std::memcpy(out, hs::stats, sizeof hs::stats); }

int hs_has_kernel(const char* name) { return hs::registry().count(name) != 0; }

// What each CTA of the last launch did, in the order they ran: eight words per CTA (x, y, barriers executed,
// global bytes read, global bytes written, atomics on global memory, distinct 4-byte words read and written,
// these two only while footprints are on; an atomic counts as a read and a write). Writes at most `max` CTAs;
// returns how many the launch ran.
int hs_cta_counts(uint64_t* out, int max) {
  const int n = static_cast<int>(hs::cta_counts.size());
  for (int i = 0; i < n && i < max; ++i) {
    const auto& c = hs::cta_counts[i];
    const uint64_t words[8] = {c.x, c.y, c.barriers, c.read_bytes, c.written_bytes, c.atomics, c.read_words,
                               c.written_words};
    std::memcpy(out + 8 * i, words, sizeof words);
  }
  return n;
}

// Whether launches look for data races on global memory (on by default).
void hs_check_races(int on) { hs::check_races = on != 0; }

// Whether launches count the distinct words each CTA reads and writes (off by default: it costs a set insert
// per access).
void hs_track_footprint(int on) { hs::track_footprint = on != 0; }

// Runs a kernel launch like cuLaunchKernel: `args` points at each parameter's value. Returns 0, or -1 with
// hs_error() saying what went wrong (unknown kernel, a barrier or collective misused, a deadlock, shared
// memory written past its end).
int hs_launch(const char* kernel, unsigned gx, unsigned gy, unsigned threads, size_t smem_bytes, void** args,
              uint64_t seed, double preempt_probability) {
  using namespace hs;
  failed = false;
  error.clear();
  auto it = registry().find(kernel);
  if (it == registry().end()) {
    fail("no kernel %s in the harness", kernel);
    return -1;
  }
  if (threads == 0 || threads > 1024 || threads % 32 != 0) {
    fail("%u threads per CTA: the harness takes a multiple of 32 up to 1024", threads);
    return -1;
  }
  rng = seed * 0x9E3779B97F4A7C15ull + 1;
  // A kernel stuck in a loop with no barrier (a probe of a table nobody cleared) ends the process.
  const char* budget = getenv("HS_LAUNCH_SECONDS");
  alarm(budget ? static_cast<unsigned>(atoi(budget)) : 60);
  hs::preempt_probability = preempt_probability;
  launch_now = {it->second, args};
  grow_fibers(threads);
  Buffer shared = map_guarded(smem_bytes);
  smem = shared.data;
  block_dim = {threads, 1, 1};
  grid_dim = {gx, gy, 1};
  std::vector<std::pair<unsigned, unsigned>> order;
  for (unsigned y = 0; y < gy; ++y) {
    for (unsigned x = 0; x < gx; ++x) order.emplace_back(x, y);
  }
  for (size_t i = order.size(); i > 1; --i) std::swap(order[i - 1], order[next_random() % i]);
  cta_counts.clear();
  launch_shadow.clear();
  for (auto [x, y] : order) {
    if (failed) break;
    block_idx = {x, y, 0};
    garbage(smem, smem_bytes);
    if (__start_hs_shared != nullptr) garbage(__start_hs_shared, __stop_hs_shared - __start_hs_shared);
    cta_counts.push_back({x, y, 0, 0, 0, 0, 0, 0});
    cta_index = static_cast<int>(cta_counts.size()) - 1;
    shadow.clear();
    read_set.clear();
    written_set.clear();
    in_cta = true;
    run_cta(static_cast<int>(threads));
    in_cta = false;
    if (!intact(shared)) fail("CTA (%u, %u) wrote past its %zu bytes of dynamic shared memory", x, y, smem_bytes);
  }
  alarm(0);
  shadow.clear();
  launch_shadow.clear();
  munmap(shared.region, shared.region_bytes);
  smem = nullptr;
  return failed ? -1 : 0;
}

}  // extern "C"

// ---------------------------------------------------------------------------------------------- instrumentation

// The hooks g++ calls from code built with -fsanitize=thread (the kernel sources; this file is not built so).
// Function entry and exit are turned off by the build (--param=tsan-instrument-func-entry-exit=0) and ignored.
#define HS_TSAN_SIZE(n)                                                                                   \
  void __tsan_read##n(void* p) { hs::global_access(p, n, false, false, __builtin_return_address(0)); }    \
  void __tsan_write##n(void* p) { hs::global_access(p, n, true, false, __builtin_return_address(0)); }    \
  void __tsan_unaligned_read##n(void* p) {                                                               \
    hs::global_access(p, n, false, false, __builtin_return_address(0));                                  \
  }                                                                                                       \
  void __tsan_unaligned_write##n(void* p) {                                                              \
    hs::global_access(p, n, true, false, __builtin_return_address(0));                                   \
  }                                                                                                       \
  void __tsan_volatile_read##n(void* p) { hs::global_access(p, n, false, false, __builtin_return_address(0)); } \
  void __tsan_volatile_write##n(void* p) { hs::global_access(p, n, true, false, __builtin_return_address(0)); }

extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
HS_TSAN_SIZE(1)
HS_TSAN_SIZE(2)
HS_TSAN_SIZE(4)
HS_TSAN_SIZE(8)
HS_TSAN_SIZE(16)
void __tsan_read_range(void* p, unsigned long n) {
  hs::global_access(p, n, false, false, __builtin_return_address(0));
}
void __tsan_write_range(void* p, unsigned long n) {
  hs::global_access(p, n, true, false, __builtin_return_address(0));
}
}  // extern "C"
#undef HS_TSAN_SIZE
