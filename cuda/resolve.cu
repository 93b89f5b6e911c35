// resolve and invalidate of cuda/SPEC.md: the kernels that rewrite the hot-region state.
#include "common.cuh"

// One CTA resolves one request. 1024 threads, so every per-element phase of a decode row (K = 2048) takes
// two block-wide steps.
#define RESOLVE_THREADS 1024
#define INVALIDATE_THREADS 256
// Pairs invalidate takes per pass; its set of their positions has twice as many entries, so it never fills.
#define INVALIDATE_BATCH 2048
// Consecutive elements a thread takes per round of resolve's first-occurrence pass.
#define ELEMENT_RUN 4
// Hot regions of at most this many blocks are checked for a repeated block pair by pair (HB^2 / blockDim
// compares a thread), which leaves resolve's hash table to serve U's lookups; larger ones with a bitmap over it.
#define HB_PAIRWISE 256
// The value half of a table entry that maps a position of U to its index in U (other values are request
// indices, below 2^31).
#define U_BIT 0x80000000u
// The short path's marks (requests of at most FAST_ROUNDS * ELEMENT_RUN * blockDim elements, so request indices
// below 2^30): a position of U holds U_BIT | q_first until a slot claims it (U_BIT | CLAIM_BIT | slot).
#define CLAIM_BIT 0x40000000u
#define FAST_ROUNDS 8

// Shared-memory hash table of positions with `cap` entries (any cap >= 4 * blockDim: the launcher sizes it
// by the selection). Each 64-bit entry is (position << 32 | value), all ones when empty (position -1 never
// enters, and every lookup of a negative position is answered before it probes). Open addressing with linear
// probing; entries are never removed, so a probe that meets an empty entry proves the position absent.
#define EMPTY_ENTRY (~0ull)

__device__ __forceinline__ u32 table_home(int pos, u32 cap) {
  return __umulhi((u32)pos * 0x9E3779B1u, cap);  // Fibonacci hashing spreads runs of positions over [0, cap)
}

__device__ __forceinline__ u32 table_next(u32 h, u32 cap) { return h + 1 == cap ? 0 : h + 1; }

__device__ __forceinline__ u64 table_entry(int pos, u32 value) { return ((u64)(u32)pos << 32) | value; }

__device__ __forceinline__ bool entry_holds(u64 entry, int pos) { return (u32)(entry >> 32) == (u32)pos; }

// Records `value` for `pos`, keeping the smallest value seen for it. Returns false without inserting when
// `pos` needs a new entry and `*claimed` (entries in use) has reached `limit`. A thread tests the limit
// before it claims, so at most limit + blockDim - 1 entries are ever claimed: with limit <= cap - blockDim
// the table never fills and every probe ends. Without `claimed` (no more positions to insert than `limit`,
// the common case), nothing is counted: one shared counter for every insert would serialize them.
__device__ bool table_insert_min(u64* tab, u32 cap, int pos, u32 value, int* claimed, int limit) {
  const u64 entry = table_entry(pos, value);
  for (u32 h = table_home(pos, cap);; h = table_next(h, cap)) {
    u64 cur = ((volatile u64*)tab)[h];
    if (cur == EMPTY_ENTRY) {
      if (claimed != nullptr && *(volatile int*)claimed >= limit) return false;
      cur = atomicCAS(&tab[h], EMPTY_ENTRY, entry);
      if (cur == EMPTY_ENTRY) {
        if (claimed != nullptr) atomicAdd(claimed, 1);
        return true;
      }
    }
    if (entry_holds(cur, pos)) {
      atomicMin(&tab[h], entry);  // same key in the high half: the minimum keeps the smallest value
      return true;
    }
  }
}

// Inserts a position known to be absent (the positions of U are distinct).
__device__ void table_insert_new(u64* tab, u32 cap, int pos, u32 value) {
  for (u32 h = table_home(pos, cap);; h = table_next(h, cap)) {
    if (atomicCAS(&tab[h], EMPTY_ENTRY, table_entry(pos, value)) == EMPTY_ENTRY) return;
  }
}

// The index of the entry of `pos` (>= 0), or HS_NONE. Only value halves may change while lookups run.
__device__ u32 table_find(const u64* tab, u32 cap, int pos) {
  for (u32 h = table_home(pos, cap);; h = table_next(h, cap)) {
    const u64 cur = tab[h];
    if (entry_holds(cur, pos)) return h;
    if (cur == EMPTY_ENTRY) return HS_NONE;
  }
}

// The value recorded for `pos` (>= 0), or HS_NONE.
__device__ u32 table_value(const u64* tab, u32 cap, int pos) {
  const u32 h = table_find(tab, cap, pos);
  return h == HS_NONE ? HS_NONE : (u32)tab[h];
}

// The index in U that the table records for `pos` (a value U_BIT | index), or HS_NONE (no entry, or an entry
// that maps a position outside U; `pos` may be negative).
__device__ u32 table_u_index(const u64* tab, u32 cap, int pos) {
  if (pos < 0) return HS_NONE;
  for (u32 h = table_home(pos, cap);; h = table_next(h, cap)) {
    const u64 cur = tab[h];
    if (entry_holds(cur, pos)) return (u32)cur >= U_BIT ? (u32)cur - U_BIT : HS_NONE;
    if (cur == EMPTY_ENTRY) return HS_NONE;
  }
}

// A request's scratch entry t is two words of the miss plan at the request's t-th element (below). Before the
// plan is written, word 0 of entry t holds U's t-th position and its slot (HS_NONE until known) and word 1 of
// entry m holds E[m], the slot miss m takes.
__device__ __forceinline__ u64 u_word(int pos, u32 slot) { return ((u64)slot << 32) | (u32)pos; }
__device__ __forceinline__ int u_pos(u64 word) { return (int)(u32)word; }
__device__ __forceinline__ u32 u_slot(u64 word) { return (u32)(word >> 32); }

__device__ __forceinline__ bool test_bit(const u32* bits, u32 s) { return (bits[s >> 5] >> (s & 31)) & 1; }

// The LRU as stamps (SPEC.md): slots least recently used first in ascending (stamp, slot). A successful step gives
// each slot of U the stamp clock << 32 | q_first (the region's clock after the step, the request index of the
// position's first occurrence: below 2^31, as the launcher keeps R * K), newer than every earlier one and in U's
// order within the step; invalidate gives emptied slots the region's smallest stamp less one.
__device__ __forceinline__ i64 make_stamp(i64 clock, u32 q_first) { return (i64)(((u64)clock << 32) | q_first); }

// A stamp as an unsigned key in the same order (the sign bit flipped), for radix digits and unsigned atomics.
__device__ __forceinline__ u64 stamp_key(i64 stamp) { return (u64)stamp ^ (1ull << 63); }

// The `count` (>= 1) oldest slots of stamps[0 .. H) whose bit in `hit` is clear, by ascending (stamp, slot): E[k]
// goes to put(k, slot), k < count; the puts are complete block-wide after the caller's next barrier (phase D's
// first scan; nothing reads them before it, so a barrier here would only cost). Three steps, each exact for any
// stamps (every i64 is a legal stamp):
//   1. radix select of T, the count-th smallest key among those slots: digits of 6 bits, most significant
//      first, each a shared histogram of the slots whose higher digits match T's so far. The histograms take
//      turns, three of 64 bins in hist (192 words): digit d counts into one while the one digit d + 1 takes is
//      cleared (its last reads were two digits ago, before the last barrier), and every warp works the digit out
//      for itself, so a digit takes one barrier. The digits above the highest bit in which the slots' smallest and
//      largest keys differ are theirs (s_range: {all ones, 0} on entry, complete block-wide before the caller's
//      last barrier), so the select starts there: a region's stamps span a few clocks, some 40 bits, not 64;
//   2. one pass in slot order: the slots below T in a list (list(c) = slot c, the caller's scratch of count
//      entries), the first `left` slots at T (ties by slot) are E[count - left ..) in slot order;
//   3. the slots below T ranked among themselves, pair by pair: (count - left)^2 compares over the block, zero
//      when every slot taken is a tie (a fresh or just invalidated region).
// Every thread of the block must call it.
template <class List, class Put>
__device__ void select_oldest(const i64* stamps, int H, const u32* hit, int count, u32* hist, int* warp_sums,
                              u64* s_range, List list, Put put) {
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int lane = tid & 31;
  for (int k = tid; k < 64; k += nt) hist[k] = 0;  // the first digit's histogram
  u64 lo = ~0ull, hi = 0;
  for (int s = tid; s < H; s += nt) {
    if (test_bit(hit, (u32)s)) continue;
    const u64 key = stamp_key(stamps[s]);
    lo = min(lo, key);
    hi = max(hi, key);
  }
  atomicMin(&s_range[0], lo);
  atomicMax(&s_range[1], hi);
  __syncthreads();  // the range is complete
  lo = s_range[0];
  hi = s_range[1];
  const int top = lo == hi ? -1 : 63 - __clzll((i64)(lo ^ hi));  // the highest bit in which keys differ
  const int first_shift = top < 0 ? -6 : top / 6 * 6;
  u64 prefix = first_shift >= 58 ? 0 : lo & (~0ull << (first_shift + 6));  // T's digits found so far
  int left = count;  // T is the left-th smallest key among the slots whose high digits equal prefix's
  for (int shift = first_shift, d = 0; shift >= 0; shift -= 6, ++d) {
    u32* cur = hist + 64 * (d % 3);
    for (int k = tid; k < 64; k += nt) hist[64 * ((d + 1) % 3) + k] = 0;
    const u64 high = shift >= 58 ? 0 : ~0ull << (shift + 6);
    for (int s = tid; s < H; s += nt) {
      if (test_bit(hit, (u32)s)) continue;
      const u64 key = stamp_key(stamps[s]);
      if ((key & high) == prefix) atomicAdd(&cur[(key >> shift) & 63], 1u);
    }
    __syncthreads();  // the histogram is complete
    // Lane l holds bins 2l, 2l + 1: the digit is the first bin where the running sum reaches left.
    const u32 c0 = cur[2 * lane], c1 = cur[2 * lane + 1];
    u32 incl = c0 + c1;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const u32 y = __shfl_up_sync(HS_FULL_MASK, incl, o);
      if (lane >= o) incl += y;
    }
    const u32 below = incl - c0 - c1;
    const int holder = __ffs(__ballot_sync(HS_FULL_MASK, below < (u32)left && incl >= (u32)left)) - 1;  // one lane
    const bool second = below + c0 < (u32)left;
    const int digit = __shfl_sync(HS_FULL_MASK, 2 * lane + second, holder);
    left -= __shfl_sync(HS_FULL_MASK, (int)(second ? below + c0 : below), holder);
    prefix |= (u64)digit << shift;
  }
  // Step 2: runs of 16 slots a thread, both counts in one scan (each below 2^16 a round: 16 * blockDim slots).
  const int less = count - left;
  int less_base = 0, tie_base = 0;
  for (int r0 = 0; r0 < H; r0 += 16 * nt) {
    const int k0 = r0 + tid * 16;
    u32 below = 0, at = 0;
#pragma unroll 4
    for (int u = 0; u < 16; ++u) {
      const int s = k0 + u;
      if (s < H && !test_bit(hit, (u32)s)) {
        const u64 key = stamp_key(stamps[s]);
        below |= (u32)(key < prefix) << u;
        at |= (u32)(key == prefix) << u;
      }
    }
    int total;
    // The last round leaves out its scan's last barrier when step 3's first one follows.
    const int packed = block_exclusive_scan(__popc(below) | __popc(at) << 16, &total, warp_sums,
                                            r0 + 16 * nt < H || less == 0);
    int lr = less_base + (packed & 0xffff);
    int tr = tie_base + (packed >> 16);
    for (int u = 0; u < 16; ++u) {
      if ((below >> u) & 1) list(lr++) = (u32)(k0 + u);
      if ((at >> u) & 1) {
        if (tr < left) put(less + tr, (u32)(k0 + u));
        ++tr;
      }
    }
    less_base += total & 0xffff;
    tie_base += total >> 16;
  }
  if (less == 0) return;
  __syncthreads();  // the list is complete
  // Step 3: the list is in slot order, so among equal stamps the earlier entry is the smaller slot. A warp takes 32
  // entries and compares them with 32 others at a time, one load a lane and 32 shuffles (loops uniform per warp).
  for (int c0 = tid - lane; c0 < less; c0 += nt) {
    const int c = c0 + lane;
    const u32 s = c < less ? (u32)list(c) : 0u;
    const u64 key = c < less ? stamp_key(stamps[s]) : 0;
    int rank = 0;
    for (int j0 = 0; j0 < less; j0 += 32) {
      const u64 mine = j0 + lane < less ? stamp_key(stamps[list(j0 + lane)]) : 0;
      for (int b = 0; b < 32 && j0 + b < less; ++b) {
        const u64 other = __shfl_sync(HS_FULL_MASK, mine, b);
        rank += other < key || (other == key && j0 + b < c);
      }
    }
    if (c < less) put(rank, s);
  }
}

// Buckets: a selection of more distinct positions than resolve's table takes goes bucket by bucket, each bucket a
// range of positions [lo, hi) that holds at most `limit` distinct selected positions, so that each fits the table.
// hist[b] counts the selected elements at positions [b << shift, (b + 1) << shift) (256 bins over [0, len)), and a
// bin holds at most min(count, width) distinct positions. The bucket from lo (a bin's start, or inside a bin too
// heavy for one bucket) takes whole bins while their bounds add up to at most limit; a heavy bin goes in ranges of
// limit positions. Returns hi. Every warp works it out for itself (lane l holds bins 8l .. 8l + 7), so no barrier
// publishes it. Not inlined: it stays out of the register budget of resolve's other phases.
__device__ __noinline__ u32 bucket_end(const u32* hist, u32 lo, u32 len, int shift, u32 limit) {
  const int lane = threadIdx.x & 31;
  const u32 b0 = lo >> shift;
  u32 w[8], sum = 0;
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    w[b] = min(hist[8 * lane + b], 1u << shift);
    sum += w[b];
  }
  u32 incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const u32 y = __shfl_up_sync(HS_FULL_MASK, incl, o);
    if (lane >= o) incl += y;
  }
  u32 run = incl - sum, before = 0, own = 0;  // on b0's lane: the bounds of the bins before b0, and b0's
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    if ((u32)(8 * lane + b) == b0) {
      before = run;
      own = w[b];
    }
    run += w[b];
  }
  before = __shfl_sync(HS_FULL_MASK, before, (int)(b0 >> 3));
  own = __shfl_sync(HS_FULL_MASK, own, (int)(b0 >> 3));
  if (own > limit) return min(min(lo + limit, (b0 + 1) << shift), len);
  u32 end = 256;  // the first bin after b0 that is heavy or would take the bucket past limit
  run = incl - sum;
#pragma unroll
  for (int b = 0; b < 8; ++b) {
    run += w[b];
    const u32 bin = 8 * lane + b;
    if (bin > b0 && end == 256 && (w[b] > limit || run - before > limit)) end = bin;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) end = min(end, __shfl_xor_sync(HS_FULL_MASK, end, o));
  return min(end << shift, len);
}

// Whether pos (-1 for none) lies in the bucket [lo, hi).
__device__ __forceinline__ bool in_bucket(int pos, u32 lo, u32 hi) { return (u32)pos - lo < hi - lo; }

// heat_row[page] += 1 for every lane whose page is >= 0, with one atomic per distinct page of the warp: a
// step's selection crowds onto a few pages (the tail, the last turn), whose counters would otherwise take up
// to 32 atomics from one warp. Every lane of the warp must call it.
__device__ __forceinline__ void add_heat(int* heat_row, int page) {
  const u32 peers = __match_any_sync(HS_FULL_MASK, page);
  if (page >= 0 && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&heat_row[page], __popc(peers));
}

// Calls f(q, gi, active) for the elements of the request's batch rows rows[0 .. n_rows), in request order
// (row-major, rows ascending): q = o * K + j is the element's index in the request, gi = rows[o] * K + j its
// index in [R, K] arrays. Every thread calls f once per block-wide chunk (active is false past the end of a
// row), so f may run block-wide scans, and an element always goes to the same thread.
template <class F>
__device__ __forceinline__ void for_each_element(const int* rows, int n_rows, int K, F f) {
  for (int o = 0; o < n_rows; ++o) {
    const u32 base = (u32)rows[o] * (u32)K;
    for (int j0 = 0; j0 < K; j0 += blockDim.x) {
      const int j = j0 + threadIdx.x;
      f((u32)(o * K + j), base + (u32)j, j < K);
    }
  }
}

// The resident path's row id of one element (SPEC.md: a request flagged resident reads every page in place): its
// block's row, or -1, with BAD_TABLE in `status` for a block outside 1 .. gpu_blocks (the null block among them),
// one atomic per warp that sees one. Every lane of the warp must call it.
__device__ __forceinline__ void resolve_in_place(const int* bt_row, int bs, int gpu_blocks, int pos, bool active,
                                                 int* out_gi, int* status) {
  const int block = pos >= 0 ? bt_row[pos / bs] : 0;
  const bool in_slab = block > 0 && block < gpu_blocks;
  if (active) *out_gi = in_slab ? block * bs + pos % bs : -1;
  if (__any_sync(HS_FULL_MASK, pos >= 0 && !in_slab) && (threadIdx.x & 31) == 0) atomicOr(status, HS_BAD_TABLE);
}

// The resident path over the hash table of first occurrences (phase A's): heat and row ids. Not inlined: inlined,
// its probe loop pushes resolve past 64 registers on sm_90, where the rest then spills.
__device__ __noinline__ void resolve_resident_hashed(const u64* tab, u32 cap, const int* rows, int n_rows, int K,
                                                     const int* topk, int len, const int* bt_row, int bs,
                                                     int gpu_blocks, int* heat_row, int* out, int* status) {
  for_each_element(rows, n_rows, K, [&](u32 q, u32 gi, bool active) {
    const int raw = active ? topk[gi] : -1;
    const int pos = raw >= 0 && raw < len ? raw : -1;
    add_heat(heat_row, pos >= 0 && table_value(tab, cap, pos) == q ? pos / bs : -1);
    resolve_in_place(bt_row, bs, gpu_blocks, pos, active, &out[gi], status);
  });
}

// resolve(topk, row_state, g, layers) of SPEC.md for one index group, all requests in one launch: the request's
// misses also go to `plan` / `plan_count` in the miss-plan format of SPEC.md, for hisparse_replay to copy into
// the group's other layers. The CTA copies its own misses into the call's layers (`layers`: the table of
// replay, L GPU layer addresses then L host ones; phase G), so a step without misses runs one launch and
// nothing after it.
//
// grid = R (one CTA per batch row), RESOLVE_THREADS threads. The CTA of a request's first batch row
// resolves the request over all its rows; the CTAs of its other rows exit at once, those of padding rows
// write -1. Dynamic shared memory, its size set by the selection (top_k x the rows of a request) and growing
// with H only by one bit per hot slot:
//   u64 tab[cap]              hash table of positions: first occurrences (phase A), whose entries of U then
//                             map U -> index in U; past HB_PAIRWISE hot blocks (or on the bucketed path), a
//                             bitmap of the hot blocks (checks 1-3), then a rebuilt map of U
//   int rows[R]               the request's batch rows
//   u32 bits[ceil(H / 32)]    slots that hold a hit (phase B)
// A request with more distinct positions than 3/4 of cap (the table fills) takes the bucketed path: the same
// phases, one table per bucket of positions (bucket_end: ranges cut from a histogram of the selection, which the
// filling pass takes in s_hist; on this path phase C's radix digits go to tab), three barriers a bucket in phase A
// (and, for a U past 3/4 of cap that misses, in phase E). The state of U (positions, slots, first request
// indices, E) lives in the request's own entries of `plan` (n_rows * K entries of 16 bytes >= |U|), and the
// request's entries of `out` serve as scratch before phase E writes them: on the bucketed path they hold the first
// request index of each member of U, in phase C they list the slots it ranks.
//
// A step without misses on the short path (below) writes its row ids, its heat and the stamps of U's slots, and
// nothing else: no scan of U, no entries, no LRU pass, no plan, no copies. Its barriers (one request row): phase
// A's first (which also counts the request's rows), its table's, its marks', and the checks' (which phase B
// shares): four; a request that selects nothing outside the resident pages skips the last. A request the core
// flags resident (`resident[r]`, below) takes the resident path: phase A's first two barriers and nothing else.
// The bucketed path's short path adds three barriers a bucket after phase A's table fills (MTP 4 at 1M tokens on a
// 99 KB part: two buckets, 17 barriers a request against the hash path's 12; benches/resolve_budget.py).
//
// Nothing here waits for the host, and every output is independent of thread scheduling: the hash table's
// layout may vary, but what it answers does not, and all state of request r is written by its CTA alone (its
// hot blocks are checked distinct; that no two requests share one is the core's duty, SPEC.md).
extern "C" __global__ void __launch_bounds__(RESOLVE_THREADS, 1)
    hisparse_resolve(const int* __restrict__ topk, const int* __restrict__ row_state,
                     const int* __restrict__ seq_lens, const int* __restrict__ block_table,
                     const int* __restrict__ host_table, const int* __restrict__ hot_blocks,
                     const u8* __restrict__ resident, int* __restrict__ hot_pos, i64* __restrict__ hot_stamp, i64* __restrict__ hot_clock,
                     int* __restrict__ heat,
                     int* __restrict__ status, u64* __restrict__ counters, int* __restrict__ out,
                     u64* __restrict__ plan, int* __restrict__ plan_count, const u64* __restrict__ layers,
                     int R, int K, int S, int P, int G,
                     int H, int HB, int g, int L, int bs, int rb, int gpu_blocks, int host_blocks, int cap) {
  HS_DYNAMIC_SHARED(u64, smem);
  __shared__ int warp_sums[32];
  __shared__ int s_claimed, s_full, s_hits, s_dup, s_host, s_status, s_u;
  __shared__ i64 s_clock;
  __shared__ u64 s_range[2];
  __shared__ u32 s_hist[256];  // the buckets' bins (the bucketed path), else phase C's radix digits

  u64* tab = smem;
  int* rows = (int*)(tab + cap);
  u32* bits = (u32*)(rows + R);
  const int words = (H + 31) / 32;

  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int i0 = blockIdx.x;
  const int r = row_state[i0];
  if (r < 0 || r >= S) {  // a padding row; a state row that does not exist is a bad argument, skipped alike
    for (int j = tid; j < K; j += nt) out[(u32)i0 * K + j] = -1;
    if (tid == 0) plan_count[i0] = 0;
    return;
  }
  bool not_first = false, later = false;
  for (int k = tid; k < R; k += nt) {
    if (row_state[k] == r) (k < i0 ? not_first : later) |= k != i0;
  }

  const int* bt_row = block_table + (i64)r * P;
  const int* ht_row = host_table + (i64)r * P;
  const int* hb_row = hot_blocks + (i64)r * HB;
  int* heat_row = heat + (i64)r * P;
  int* hp = hot_pos + ((i64)r * G + g) * H;
  i64* hs = hot_stamp + ((i64)r * G + g) * H;
  const int raw_len = seq_lens[r];
  const int len = min(max(raw_len, 0), P * bs);  // the launcher keeps P * bs below 2^31
  const int limit = cap - cap / 4;                // cap / 4 >= blockDim: see table_insert_min
  const int shift = len > 256 ? 24 - __clz(len - 1) : 0;  // bins of 1 << shift positions: 256 cover [0, len)

  // -1 for padding and for positions outside [0, len).
  auto position = [&](u32 gi, bool active) {
    const int pos = active ? topk[gi] : -1;
    return pos >= 0 && pos < len ? pos : -1;
  };
  // The page's block: 0 (not resident), a resident block, or -1 for an entry outside the slab (skipped).
  auto block_of = [&](int pos) {
    const int b = bt_row[pos / bs];
    return b >= 0 && b < gpu_blocks ? b : -1;
  };
  auto hot_row = [&](u32 slot) { return hb_row[slot / bs] * bs + (int)(slot % bs); };
  // Check 4's flags for a miss at pos: its page without a host copy, or with one outside the pool.
  auto host_flags = [&](int pos) {
    const int host_block = ht_row[pos / bs];
    return host_block < 0 ? HS_NO_HOST_COPY : host_block >= host_blocks ? HS_BAD_TABLE : 0;
  };
  auto entry = [&](u32 t) { return plan + 2u * ((u32)rows[t / K] * (u32)K + t % K); };

  // Phase A: heat of every distinct valid position, and U (valid, block 0, in order of first occurrence) into
  // the entries. First occurrence = the element whose request index q is the smallest of its position's.
  for (int k = tid; k < cap; k += nt) tab[k] = EMPTY_ENTRY;
  for (int k = tid; k < words; k += nt) bits[k] = 0;  // hit slots
  for (int k = tid; k < 256; k += nt) s_hist[k] = 0;  // the buckets' bins
  if (tid == 0) {
    s_claimed = 0;
    s_full = 0;
    s_hits = 0;
    s_u = 0;
    s_range[0] = ~0ull;  // phase C's smallest and largest key
    s_range[1] = 0;
    s_dup = 0;
    s_host = 0;
    s_status = raw_len == len ? 0 : HS_BAD_TABLE;
    rows[0] = i0;
  }
  // One barrier clears the shared state and tells every thread whether the request has other rows: each warp's
  // votes go to warp_sums (bit 0: a row of r before i0, whose CTA resolves the request; bit 1: one after it).
  const u32 vote_first = __ballot_sync(HS_FULL_MASK, not_first);
  const u32 vote_later = __ballot_sync(HS_FULL_MASK, later);
  if ((tid & 31) == 0) warp_sums[tid >> 5] = (vote_first != 0) | (vote_later != 0) << 1;
  __syncthreads();  // also publishes rows[0]
  int votes = 0;
  for (int w = 0; w < (nt + 31) >> 5; ++w) votes |= warp_sums[w];
  if (votes & 1) return;
  // The request's batch rows: i0 alone (a decode step without speculation: no scan), or every row of r.
  int n_rows = 1;
  if (votes & 2) {
    __syncthreads();  // every thread has read the votes: the scan below rewrites warp_sums
    n_rows = 0;
    for (int k0 = i0; k0 < R; k0 += nt) {
      const bool mine = k0 + tid < R && row_state[k0 + tid] == r;
      int total;
      const int o = n_rows + block_exclusive_scan(mine, &total, warp_sums, k0 + nt < R);
      if (mine) rows[o] = k0 + tid;
      n_rows += total;
    }
    __syncthreads();  // publishes rows
  }
  // A selection larger than the table may fill it; its elements also go to the buckets' bins (bucket_end).
  int* claimed = n_rows * K > limit ? &s_claimed : nullptr;
  for_each_element(rows, n_rows, K, [&](u32 q, u32 gi, bool active) {
    const int pos = position(gi, active);
    if (pos >= 0 && !table_insert_min(tab, cap, pos, q, claimed, limit)) s_full = 1;
    if (pos >= 0 && claimed != nullptr) atomicAdd(&s_hist[pos >> shift], 1u);
  });
  __syncthreads();

  // The bucketed path (the table filled: more distinct positions than it takes) runs body(lo, hi) for each bucket.
  auto for_each_bucket = [&](auto body) {
    for (u32 lo = 0, hi; lo < (u32)len; lo = hi) {
      hi = bucket_end(s_hist, lo, (u32)len, shift, (u32)limit);
      body(lo, hi);
    }
  };
  // First occurrences bucket by bucket: the table of the bucket's positions and their first request indices, then
  // visit(q, gi, pos, f) for every element (pos -1 outside the bucket; f = the first request index of pos), three
  // barriers a bucket. With `claim`, phase B too (the hits, see there): each element's entry starts as its position
  // without a slot, and each hot slot holding a selected position of U (valid, block 0) marks its table entry
  // (U_BIT: a second slot finds it marked) and takes the entry of the position's first occurrence. The marks
  // leave every f readable, so visits and claims share one interval.
  auto bucketed_firsts = [&](bool claim, auto visit) {
    for_each_bucket([&](u32 lo, u32 hi) {
      for (int k = tid; k < cap; k += nt) tab[k] = EMPTY_ENTRY;
      __syncthreads();
      for_each_element(rows, n_rows, K, [&](u32 q, u32 gi, bool active) {
        const int pos = position(gi, active);
        if (!in_bucket(pos, lo, hi)) return;
        table_insert_min(tab, cap, pos, q, nullptr, 0);  // at most limit positions: no count
        if (claim) ((u32*)entry(q))[1] = HS_NONE;  // the slot half of word 0
      });
      __syncthreads();
      for_each_element(rows, n_rows, K, [&](u32 q, u32 gi, bool active) {
        const int pos = position(gi, active);
        const bool mine = in_bucket(pos, lo, hi);
        visit(q, gi, mine ? pos : -1, mine ? table_value(tab, cap, pos) & ~U_BIT : HS_NONE);
      });
      if (claim) {
        int hits = 0;
        for_each_loaded<3>(hp, H, [&](int s, int pos) {
          const u32 h = in_bucket(pos, lo, hi) ? table_find(tab, cap, pos) : HS_NONE;
          if (h == HS_NONE || block_of(pos) != 0) return;
          const u64 mark = atomicOr(&tab[h], (u64)U_BIT);
          if ((u32)mark & U_BIT) {
            s_dup = 1;  // a second slot holds the position
            return;
          }
          atomicOr(&bits[s >> 5], 1u << (s & 31));
          ((u32*)entry((u32)mark))[1] = (u32)s;
          ++hits;
        });
        if (hits > 0) atomicAdd(&s_hits, hits);
      }
      __syncthreads();  // tab is cleared next (or, after the last bucket, n, the hits and the flags are complete)
    });
  };

  // The resident path: a request flagged resident reads every page in place (SPEC.md), so it has no U: each element
  // writes its row id (-1 and BAD_TABLE for a block outside 1 .. gpu_blocks, the null block among them) and each
  // first occurrence its heat, and that is all: no hot state, no entries, no plan, and with the table no barrier
  // after phase A's two (one request row). Bad blocks go straight to status, one atomic per warp that sees one, as
  // no barrier follows to gather them in s_status. (`resident` may be null: no request flagged.)
  if (resident != nullptr && resident[r] != 0) {
    if (!s_full) {
      resolve_resident_hashed(tab, (u32)cap, rows, n_rows, K, topk, len, bt_row, bs, gpu_blocks, heat_row, out,
                              &status[r]);
    } else {
      bucketed_firsts(false, [&](u32 q, u32, int pos, u32 f) { add_heat(heat_row, f == q ? pos / bs : -1); });
      for_each_element(rows, n_rows, K, [&](u32, u32 gi, bool active) {
        resolve_in_place(bt_row, bs, gpu_blocks, position(gi, active), active, &out[gi], &status[r]);
      });
    }
    for (int o = tid; o < n_rows; o += nt) plan_count[rows[o]] = 0;
    if (tid == 0 && s_status != 0) atomicOr(&status[r], s_status);  // tid 0's own flag (the length's)
    return;
  }

  // Read once, here (a flagged request never has a U to stamp): only this CTA writes it (at the end), and the CTAs
  // of r's other rows never read it. Its first reader is behind a barrier still to come (phase A's marks, or the
  // checks', which every request with a U passes).
  if (tid == 0) s_clock = hot_clock[(i64)r * G + g];

  int n = 0;  // |U|
  const int count = n_rows * K;
  // The short path: the hash table, hot blocks checked pair by pair, a selection of at most FAST_ROUNDS rounds.
  // U is not compacted unless something misses: phase A marks U's positions in the table (U_BIT | q_first) and
  // counts them, each thread keeping which of its elements are first occurrences of U (bit round * ELEMENT_RUN + u
  // of firsts); phase B claims each hit's mark for its slot, in the checks' interval. A request that hits
  // everything then writes its row ids and stamps at once (phase E); one that misses compacts U (phase A2) and
  // goes on as the long path does.
  const bool fast = !s_full && HB <= HB_PAIRWISE && count <= FAST_ROUNDS * ELEMENT_RUN * nt;
  u32 firsts = 0;
  // Calls f(q, gi, u_bit, active) for this thread's elements in the short path's order: ELEMENT_RUN consecutive
  // ones a round (every thread ELEMENT_RUN calls a round, active false past the end, so that f may use warp
  // collectives); u_bit is the element's bit in firsts.
  auto for_each_run = [&](auto f) {
    for (int r0 = 0, round = 0; r0 < count; r0 += ELEMENT_RUN * nt, ++round) {
      const int q0 = r0 + tid * ELEMENT_RUN;
#pragma unroll
      for (int u = 0; u < ELEMENT_RUN; ++u) {
        const int q = q0 + u;
        const bool active = q < count;
        const u32 gi = active ? (u32)rows[q / K] * (u32)K + (u32)(q % K) : 0u;
        f((u32)q, gi, 1u << (round * ELEMENT_RUN + u), active);
      }
    }
  };
  if (fast) {
    int marked = 0;
    for_each_run([&](u32 q, u32 gi, u32 u_bit, bool active) {
      const int pos = position(gi, active);
      const u32 h = pos >= 0 ? table_find(tab, cap, pos) : HS_NONE;
      const bool first = h != HS_NONE && (u32)tab[h] == q;
      add_heat(heat_row, first ? pos / bs : -1);
      const int block = first ? block_of(pos) : 1;
      if (block < 0) atomicOr(&s_status, HS_BAD_TABLE);
      if (block == 0) {  // later elements of the position compare their own q, which U_BIT | q never equals
        tab[h] = table_entry(pos, U_BIT | q);
        firsts |= u_bit;
        ++marked;
      }
    });
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) marked += __shfl_xor_sync(HS_FULL_MASK, marked, o);
    if ((tid & 31) == 0 && marked > 0) atomicAdd(&s_u, marked);
    __syncthreads();  // U's marks and count are complete
    n = s_u;
  } else if (!s_full) {
    // Each thread takes ELEMENT_RUN consecutive elements per round, so one scan orders a round of
    // ELEMENT_RUN * blockDim elements (a decode row of K = 2048 takes one round).
    for (int r0 = 0; r0 < count; r0 += ELEMENT_RUN * nt) {
      const int q0 = r0 + tid * ELEMENT_RUN;
      int u_pos_of[ELEMENT_RUN];
      u32 in_u = 0;  // bit u: element q0 + u is the first occurrence of a position of U
#pragma unroll
      for (int u = 0; u < ELEMENT_RUN; ++u) {
        const int q = q0 + u;
        const bool active = q < count;
        const int pos = position(active ? (u32)rows[q / K] * (u32)K + (u32)(q % K) : 0u, active);
        const bool first = pos >= 0 && table_value(tab, cap, pos) == (u32)q;
        add_heat(heat_row, first ? pos / bs : -1);
        const int block = first ? block_of(pos) : 1;
        if (block < 0) atomicOr(&s_status, HS_BAD_TABLE);
        u_pos_of[u] = pos;
        if (block == 0) in_u |= 1u << u;
      }
      int total;  // the last round's scan needs no last barrier: the checks pass barriers before the next scan
      int t = n + block_exclusive_scan(__popc(in_u), &total, warp_sums, r0 + ELEMENT_RUN * nt < count);
#pragma unroll
      for (int u = 0; u < ELEMENT_RUN; ++u) {
        if (!((in_u >> u) & 1)) continue;
        entry(t)[0] = u_word(u_pos_of[u], HS_NONE);
        ((u32*)entry(t))[2] = (u32)(q0 + u);  // its stamp's low half (phase D)
        // The entry now maps the position to its index in U (phase B and E's lookups). Later rounds still
        // compare request indices, which U_BIT never equals. Past HB_PAIRWISE the checks clear tab for their
        // bitmap as soon as this round is done: no write then.
        if (HB <= HB_PAIRWISE) tab[table_find(tab, cap, u_pos_of[u])] = table_entry(u_pos_of[u], U_BIT | (u32)t);
        ++t;
      }
      n += total;
    }
  } else {
    // More distinct positions than the table takes: the bucketed path, a short path too. Phase A and B bucket by
    // bucket (above), counting U; out[gi] holds the first request index of each member of U until phase E (or
    // phase A2, which compacts U when something misses) reads it.
    bucketed_firsts(true, [&](u32 q, u32 gi, int pos, u32 f) {
      const bool first = f == q;
      add_heat(heat_row, first ? pos / bs : -1);
      const int block = pos >= 0 ? block_of(pos) : 1;
      if (first && block < 0) atomicOr(&s_status, HS_BAD_TABLE);
      if (block == 0) out[gi] = (int)f;
      const u32 marked = __ballot_sync(HS_FULL_MASK, first && block == 0);
      if ((tid & 31) == 0 && marked != 0) atomicAdd(&s_u, __popc(marked));
    });
    n = s_u;
  }

  // Runs consume(find), find(pos) = the index of pos in U or HS_NONE: through the hash table of U when U fits
  // it (built when `build`; nothing else writes tab once it is), else once per bucket (the bucketed path's), where
  // find answers only for the bucket's positions: consumers act on found positions alone, so each acts once.
  // Every consumer action is complete block-wide when it returns, except, with one table, when `sync` is false
  // (the caller's last use: nothing after it reads what consume writes, nor writes what it reads).
  auto with_u_map = [&](bool build, bool sync, auto consume) {
    if (n <= limit) {
      if (build) {
        for (int k = tid; k < cap; k += nt) tab[k] = EMPTY_ENTRY;
        __syncthreads();
        for (int t = tid; t < n; t += nt) table_insert_new(tab, cap, u_pos(entry(t)[0]), U_BIT | (u32)t);
        __syncthreads();
      }
      consume([&](int pos) { return table_u_index(tab, cap, pos); });
      if (sync) __syncthreads();
    } else {
      for_each_bucket([&](u32 lo, u32 hi) {
        for (int k = tid; k < cap; k += nt) tab[k] = EMPTY_ENTRY;
        __syncthreads();
        for (int t = tid; t < n; t += nt) {
          const int pos = u_pos(entry(t)[0]);
          if (in_bucket(pos, lo, hi)) table_insert_new(tab, cap, pos, U_BIT | (u32)t);
        }
        __syncthreads();
        consume([&](int pos) { return in_bucket(pos, lo, hi) ? table_u_index(tab, cap, pos) : HS_NONE; });
        __syncthreads();
      });
    }
  };

  // Checks 1-2 of SPEC step 4: overflow; the hot blocks in range and distinct (pair by pair up to HB_PAIRWISE
  // blocks; else seen: a bitmap of block ids over tab, which phase A's table then gives up, in windows of
  // 64 * cap ids: one window unless the slab has more blocks). Nothing reads U's entries or the table's U marks
  // before the barrier below; a request that stops here reads none. The short path's phase B runs before that
  // barrier too: it writes only shared memory, and a claimed mark that a claim finds is check 3's BAD_HOT. (The
  // bucketed path's ran in phase A, whatever the checks find: what it wrote counts only for a request that passes.)
  bool ok = n > 0 && n <= H && hb_row[0] != 0;
  if (n > 0 && !ok && tid == 0) s_status |= HS_OVERFLOW;
  if (ok) {
    bool bad = false;
    for (int b = tid; b < HB; b += nt) bad |= hb_row[b] <= 0 || hb_row[b] >= gpu_blocks;
    if (HB <= HB_PAIRWISE) {
      for (int p = tid; p < HB * HB; p += nt) {
        const int a = p / HB;
        const int b = p % HB;
        bad |= a < b && hb_row[a] == hb_row[b];
      }
    } else {
      u32* seen = (u32*)tab;
      const u32 window_ids = 64u * (u32)cap;
      auto clear_window = [&](u32 w) {
        const u32 ids = min(window_ids, (u32)gpu_blocks - w);
        for (u32 k = tid; k < (ids + 31) / 32; k += nt) seen[k] = 0;
      };
      auto mark_window = [&](u32 w) {  // a block seen twice in this window is a repeat
        for (int b = tid; b < HB; b += nt) {
          const u32 id = (u32)hb_row[b] - w;
          if (hb_row[b] > 0 && hb_row[b] < gpu_blocks && id < window_ids) {
            const u32 m = 1u << (id & 31);
            bad |= (atomicOr(&seen[id >> 5], m) & m) != 0;
          }
        }
      };
      clear_window(0);
      __syncthreads();  // the first window is clear
      mark_window(0);
      for (u32 w = window_ids; w < (u32)gpu_blocks; w += window_ids) {
        __syncthreads();  // the last window's marks are done
        clear_window(w);
        __syncthreads();
        mark_window(w);
      }
    }
    if (fast) {
      int hits = 0;
      for_each_loaded<3>(hp, H, [&](int s, int pos) {
        const u32 h = pos >= 0 ? table_find(tab, cap, pos) : HS_NONE;
        if (h == HS_NONE) return;
        const u64 mark = tab[h];
        if (!((u32)mark & U_BIT)) return;  // a position outside U
        if (!((u32)mark & CLAIM_BIT) && atomicCAS(&tab[h], mark, table_entry(pos, U_BIT | CLAIM_BIT | s)) == mark) {
          atomicOr(&bits[s >> 5], 1u << (s & 31));
          ++hits;
        } else {
          bad = true;  // a second slot holds the position
        }
      });
      if (hits > 0) atomicAdd(&s_hits, hits);
    }
    if (s_full) bad |= s_dup != 0;  // the bucketed path's claims (phase A's)
    // Also orders phase A's entries and table marks before phase B's lookups (and, past HB_PAIRWISE, the bitmap's
    // last reads before tab is rebuilt); on the short path, phase B's claims and hit count before what follows.
    ok = !__syncthreads_or(bad);
    if (!ok && tid == 0) s_status |= HS_BAD_HOT;
  }

  // Phase B: hits. A slot holding a position of U claims the position's entry and sets its bit in bits; a second
  // slot holding it is corrupt state (check 3). Phase A's table maps U already unless it gave way to the hot-block
  // bitmap. (The short paths claim in phase A and the checks.)
  int n_miss = 0;
  if (ok && !fast && !s_full) {
    with_u_map(HB > HB_PAIRWISE, true, [&](auto find) {
      int hits = 0;
      // Runs of 3: with 4 the probe loop's registers spill on sm_90 (benches/kernel_report.py).
      for_each_loaded<3>(hp, H, [&](int s, int pos) {
        const u32 t = find(pos);
        if (t == HS_NONE) return;
        if (atomicCAS(entry(t), u_word(pos, HS_NONE), u_word(pos, s)) == u_word(pos, HS_NONE)) {
          atomicOr(&bits[s >> 5], 1u << (s & 31));
          ++hits;
        } else {
          s_dup = 1;
        }
      });
      if (hits > 0) atomicAdd(&s_hits, hits);
    });
    ok = !s_dup;
    if (!ok && tid == 0) s_status |= HS_BAD_HOT;
  }
  // The short paths: done when everything hit; else phase A2 compacts U (in request order, a scan a round) into the
  // entries as the long path's phase A does, each entry with its hit's slot, (not bucketed) makes the table map U
  // to it, and runs check 4 on the misses.
  const bool done = (fast || s_full) && ok && s_hits == n;
  int host = 0;  // check 4's flags of this thread's misses
  if (fast && ok && !done) {
    int t0 = 0;
    for (int r0 = 0, round = 0; r0 < count; r0 += ELEMENT_RUN * nt, ++round) {
      const u32 mine = (firsts >> (round * ELEMENT_RUN)) & ((1u << ELEMENT_RUN) - 1);
      int total;
      // The last round's scan leaves out its last barrier: the one after the loop serves.
      int t = t0 + block_exclusive_scan(__popc(mine), &total, warp_sums, r0 + ELEMENT_RUN * nt < count);
      const int q0 = r0 + tid * ELEMENT_RUN;
      for (int u = 0; u < ELEMENT_RUN; ++u) {
        if (!((mine >> u) & 1)) continue;
        const int q = q0 + u;
        const int pos = position((u32)rows[q / K] * (u32)K + (u32)(q % K), true);
        const u32 h = table_find(tab, cap, pos);
        const u32 mark = (u32)tab[h];
        entry(t)[0] = u_word(pos, mark & CLAIM_BIT ? mark & ~(U_BIT | CLAIM_BIT) : HS_NONE);
        if (!(mark & CLAIM_BIT)) host |= host_flags(pos);
        ((u32*)entry(t))[2] = (u32)q;
        tab[h] = table_entry(pos, U_BIT | (u32)t);
        ++t;
      }
      t0 += total;
    }
  } else if (s_full && ok && !done) {
    // The first occurrences of U (out[gi] == q) move their entries (position and slot, from phase A) down to U's
    // order: a round reads all its entries before its scan, and entry t <= q.
    block_runs<u64, 4>(
        count,
        [&](int q) {
          const u32 gi = (u32)rows[q / K] * (u32)K + (u32)(q % K);
          const int pos = position(gi, true);
          return pos >= 0 && block_of(pos) == 0 && out[gi] == q ? u_word(pos, ((u32*)entry((u32)q))[1]) : ~0ull;
        },
        [&](u64 word) { return word != ~0ull; },
        [&](int q, u64 word, bool first, int t) {
          if (!first) return;
          entry((u32)t)[0] = word;
          if (u_slot(word) == HS_NONE) host |= host_flags(u_pos(word));
          ((u32*)entry((u32)t))[2] = (u32)q;
        },
        warp_sums, false);
  }
  if ((fast || s_full) && ok && !done) {
    if (host != 0) atomicOr(&s_host, host);
    __syncthreads();  // the entries (and the table's map of U) and check 4's flags are complete
  }
  if (done && s_full) {
    // The bucketed path, everything hit: as below, each element's slot from the entry of its first occurrence.
    const i64 clock = s_clock + 1;
    for_each_element(rows, n_rows, K, [&](u32 q, u32 gi, bool active) {
      const int pos = position(gi, active);
      const int block = pos >= 0 ? block_of(pos) : -1;
      int row = block > 0 ? block * bs + pos % bs : -1;
      if (block == 0) {  // only a first occurrence's entry has a slot; the others' out[gi] name theirs
        u32 slot = ((const u32*)entry(q))[1];
        if (slot != HS_NONE) hs[slot] = make_stamp(clock, q);
        else slot = ((const u32*)entry((u32)out[gi]))[1];
        row = hot_row(slot);
      }
      if (active) out[gi] = row;
    });
  } else if (done) {
    // The short path, everything hit: every element's row id, and each position's first occurrence stamps its
    // slot (the claim in its mark) with this step's clock and its own request index.
    const i64 clock = s_clock + 1;
    for_each_run([&](u32 q, u32 gi, u32 u_bit, bool active) {
      if (!active) return;
      const int pos = position(gi, true);
      const int block = pos >= 0 ? block_of(pos) : -1;
      int row = block > 0 ? block * bs + pos % bs : -1;
      if (block == 0) {
        const u32 slot = table_value(tab, cap, pos) & ~(U_BIT | CLAIM_BIT);
        row = hot_row(slot);
        if (firsts & u_bit) hs[slot] = make_stamp(clock, q);
      }
      out[gi] = row;
    });
  }
  // Check 4: every miss's page has a host copy inside the pool (the short paths' phase A2 checked as it went).
  // (s_hits is complete: phase B's barrier.)
  if (ok) n_miss = n - s_hits;
  if (ok && n_miss > 0) {
    if (!fast && !s_full) {
      int flags = 0;
      for (int t = tid; t < n; t += nt) {
        const u64 word = entry(t)[0];
        if (u_slot(word) == HS_NONE) flags |= host_flags(u_pos(word));
      }
      if (flags != 0) atomicOr(&s_host, flags);
      __syncthreads();
    }
    ok = s_host == 0;
    if (!ok && tid == 0) s_status |= s_host;
  }

  if (ok && !done) {
    const i64 clock = s_clock + 1;  // this step's (the region's clock after it)
    // Phase C, the LRU: E[0 .. |M|), the |M| oldest slots that hold no hit (select_oldest), to the high halves of
    // the entries' word 1; out's entries of the request list the slots it ranks. Nothing without misses.
    if (n_miss > 0) {
      select_oldest(
          hs, H, bits, n_miss, s_full ? (u32*)tab : s_hist, warp_sums, s_range,
          [&](int c) -> int& { return out[(u32)rows[c / K] * (u32)K + (u32)(c % K)]; },
          [&](int m, u32 s) { ((u32*)entry((u32)m))[3] = s; });
    }

    // Phase D: U in order (block_runs' first scan completes phase C's puts). Miss m takes slot E[m] and its
    // position; every slot of U gets this step's stamp with its position's first request index (word 1's low
    // half). Without misses every slot of U is known and holds its position already: no scan, and nothing after
    // this reads what it writes.
    if (n_miss > 0) {
      block_runs<u64, 4>(
          n, [&](int t) { return entry(t)[0]; }, [&](u64 word) { return u_slot(word) == HS_NONE; },
          [&](int t, u64 word, bool miss, int m) {
            u32 slot = u_slot(word);
            if (miss) {
              slot = ((const u32*)entry(m))[3];
              entry(t)[0] = u_word(u_pos(word), slot);
              hp[slot] = u_pos(word);
            }
            hs[slot] = make_stamp(clock, ((const u32*)entry(t))[2]);
          },
          warp_sums);
      __syncthreads();  // U's slots are complete
    } else {
      for (int t = tid; t < n; t += nt) hs[u_slot(entry(t)[0])] = make_stamp(clock, ((const u32*)entry(t))[2]);
    }
  }

  // Phase E: row ids. Every element but U's members first; then U's members, from their slots.
  if (!done) {
    for_each_element(rows, n_rows, K, [&](u32, u32 gi, bool active) {
      if (!active) return;
      const int pos = position(gi, true);
      const int block = pos >= 0 ? block_of(pos) : -1;
      out[gi] = block > 0 ? block * bs + pos % bs : -1;
    });
  }
  if (ok && !done) {
    // Phase F below rewrites the entries this reads: only then must every lookup be done first.
    with_u_map(s_full, n_miss > 0, [&](auto find) {
      for_each_element(rows, n_rows, K, [&](u32, u32 gi, bool active) {
        const int pos = position(gi, active);
        if (pos < 0 || block_of(pos) != 0) return;
        const u32 t = find(pos);
        if (t != HS_NONE) out[gi] = hot_row(u_slot(entry(t)[0]));
      });
    });

    // Phase F: the plan. Misses (the slots of U that held no hit) in U's order, compacted in place
    // (block_runs: miss m lands in entry m <= t).
    if (n_miss > 0) {
      block_runs<u64, 4>(
          n, [&](int t) { return entry(t)[0]; }, [&](u64 word) { return !test_bit(bits, u_slot(word)); },
          [&](int, u64 word, bool miss, int m) {
            if (!miss) return;
            const int pos = u_pos(word);
            u64* pair = entry(m);
            pair[0] = (u64)(i64)hot_row(u_slot(word));
            pair[1] = (u64)((i64)ht_row[pos / bs] * bs + pos % bs);
          },
          warp_sums, false);  // the last scan
      __syncthreads();  // the plan is complete

      // Phase G: the copies into the call's layers, host row to GPU row of every miss (both checked above: a
      // slot of a checked hot region, a host block below host_blocks). A round takes the 16-byte chunks of up to
      // 4 * blockDim / chunks (miss, layer) rows as one list, four loads per thread before their stores, so that
      // many reads of pinned host memory are in flight at once even for a few misses.
      const u32 chunks = (u32)rb >> 4;
      const u32 jobs = (u32)n_miss * (u32)L;  // below 2^31: the launcher keeps R * K * L there
      const u32 per_round = max(1u, 4u * (u32)nt / chunks);
      for (u32 j0 = 0; j0 < jobs; j0 += per_round) {
        const u32 span = min(per_round, jobs - j0) * chunks;
        for (u32 c0 = tid; c0 < span; c0 += 4u * (u32)nt) {
          uint4 v[4];
          uint4* dst[4];
#pragma unroll
          for (u32 u = 0; u < 4; ++u) {
            const u32 c = c0 + u * (u32)nt;
            if (c < span) {
              const u32 job = j0 + c / chunks;
              const u32 l = job / (u32)n_miss;
              const u64* pair = entry(job % (u32)n_miss);
              v[u] = ((const uint4*)(layers[L + l] + pair[1] * (u64)rb))[c % chunks];
              dst[u] = (uint4*)(layers[l] + pair[0] * (u64)rb) + c % chunks;
            }
          }
#pragma unroll
          for (u32 u = 0; u < 4; ++u) {
            if (c0 + u * (u32)nt < span) *dst[u] = v[u];
          }
        }
      }
    }
  }
  const int planned = ok ? n_miss : 0;
  for (int o = tid; o < n_rows; o += nt) plan_count[rows[o]] = min(max(planned - o * K, 0), K);

  if (tid == 0) {
    // Atomic: two groups of one request may be resolved at once on different streams.
    if (s_status != 0) atomicOr(&status[r], s_status);
    if (ok) {
      hot_clock[(i64)r * G + g] = s_clock + 1;
      atomicAdd(&counters[0], (u64)(n - n_miss));
      atomicAdd(&counters[1], (u64)n_miss);
      atomicAdd(&counters[2], (u64)n_miss * (u64)rb * (u64)L);
    }
  }
}

// A set of positions (>= 0) in `cap` u32 entries, HS_NONE when empty; it is never full.
__device__ void set_insert(u32* keys, u32 cap, int pos) {
  for (u32 h = table_home(pos, cap);; h = table_next(h, cap)) {
    const u32 cur = atomicCAS(&keys[h], HS_NONE, (u32)pos);
    if (cur == HS_NONE || cur == (u32)pos) return;
  }
}

__device__ bool set_contains(const u32* keys, u32 cap, int pos) {
  for (u32 h = table_home(pos, cap);; h = table_next(h, cap)) {
    if (keys[h] == (u32)pos) return true;
    if (keys[h] == HS_NONE) return false;
  }
}

// invalidate(pairs) of SPEC.md. grid = (S, G), INVALIDATE_THREADS threads: CTA (r, g) takes the pairs of
// state row r (a row outside [0, S) matches no CTA) in passes of INVALIDATE_BATCH pairs, each a set of their
// positions and one sweep of the slots; then the emptied slots take the stamp one below the region's smallest
// (the subtraction saturates: a region already holding the smallest i64 gets that). Dynamic shared memory:
// u32 keys[2 * INVALIDATE_BATCH], then u32 emptied[ceil(H / 32)] (bits of slots).
extern "C" __global__ void __launch_bounds__(INVALIDATE_THREADS)
    hisparse_invalidate(const int* __restrict__ pairs, int n, int* __restrict__ hot_pos,
                        i64* __restrict__ hot_stamp, int G, int H) {
  HS_DYNAMIC_SHARED(u32, keys);
  __shared__ u64 s_least;  // the smallest stamp of the region, as a stamp_key

  const u32 cap = 2 * INVALIDATE_BATCH;
  const int words = (H + 31) / 32;
  u32* emptied = keys + cap;
  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int r = blockIdx.x;
  int* hp = hot_pos + ((i64)r * G + blockIdx.y) * H;
  i64* hs = hot_stamp + ((i64)r * G + blockIdx.y) * H;
  if (n <= 0) return;

  for (int k = tid; k < words; k += nt) emptied[k] = 0;
  if (tid == 0) s_least = ~0ull;  // every pass below begins with a barrier
  bool any_emptied = false;
  for (int b0 = 0; b0 < n; b0 += INVALIDATE_BATCH) {
    // Most CTAs find no pair of their row: they read the pairs and go on.
    const int b1 = min(n, b0 + INVALIDATE_BATCH);
    bool mine = false;
    for (int p = b0 + tid; p < b1 && !mine; p += nt) mine = pairs[2 * p] == r && pairs[2 * p + 1] >= 0;
    if (!__syncthreads_or(mine)) continue;
    for (u32 k = tid; k < cap; k += nt) keys[k] = HS_NONE;
    __syncthreads();
    for (int p = b0 + tid; p < b1; p += nt) {
      const int pos = pairs[2 * p + 1];
      if (pairs[2 * p] == r && pos >= 0) set_insert(keys, cap, pos);
    }
    __syncthreads();
    bool hit = false;
    for_each_loaded(hp, H, [&](int s, int pos) {
      if (pos >= 0 && set_contains(keys, cap, pos)) {
        hp[s] = -1;
        atomicOr(&emptied[s >> 5], 1u << (s & 31));
        hit = true;
      }
    });
    any_emptied |= __syncthreads_or(hit);
  }
  if (!any_emptied) return;

  u64 least = ~0ull;
  for (int s = tid; s < H; s += nt) least = min(least, stamp_key(hs[s]));
  atomicMin(&s_least, least);
  __syncthreads();  // s_least is complete, and every stamp read before any is written
  const i64 smallest = (i64)(s_least ^ (1ull << 63));
  const i64 front = smallest == (i64)(1ull << 63) ? smallest : smallest - 1;
  for (int s = tid; s < H; s += nt) {
    if (test_bit(emptied, (u32)s)) hs[s] = front;
  }
}
