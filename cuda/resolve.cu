// resolve and invalidate of cuda/SPEC.md: the kernels that rewrite the hot-region state.
#include "common.cuh"

// One CTA resolves one request. 1024 threads, so every per-element phase of a decode row (K = 2048) takes
// two block-wide steps, and the copies of a request's misses have many loads in flight.
#define RESOLVE_THREADS 1024

// Shared-memory hash table of positions: each 64-bit entry is (position << 32 | value), all ones when
// empty (position -1 never enters). Open addressing with linear probing; entries are never removed, so a
// probe that meets an empty entry proves the position absent.
#define EMPTY_ENTRY (~0ull)
#define NO_VALUE 0xffffffffu

__device__ __forceinline__ u32 table_home(int pos, int log2c) {
  return ((u32)pos * 0x9E3779B1u) >> (32 - log2c);  // Fibonacci hashing spreads runs of positions
}

__device__ __forceinline__ u64 table_entry(int pos, u32 value) { return ((u64)(u32)pos << 32) | value; }

__device__ __forceinline__ bool entry_holds(u64 entry, int pos) { return (u32)(entry >> 32) == (u32)pos; }

// Records `value` for `pos`, keeping the smallest value seen for it. Returns false without inserting when
// `pos` needs a new entry and `*claimed` (entries in use) has reached `limit`. A thread tests the limit
// before it claims, so at most limit + blockDim - 1 entries are ever claimed: with limit = C / 2 and
// C >= 2 * blockDim the table never fills and every probe ends.
__device__ bool table_insert_min(u64* tab, int log2c, int pos, u32 value, int* claimed, int limit) {
  const u32 mask = (1u << log2c) - 1;
  const u64 entry = table_entry(pos, value);
  for (u32 h = table_home(pos, log2c);; h = (h + 1) & mask) {
    u64 cur = ((volatile u64*)tab)[h];
    if (cur == EMPTY_ENTRY) {
      if (*(volatile int*)claimed >= limit) return false;
      cur = atomicCAS(&tab[h], EMPTY_ENTRY, entry);
      if (cur == EMPTY_ENTRY) {
        atomicAdd(claimed, 1);
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
__device__ void table_insert_new(u64* tab, int log2c, int pos, u32 value) {
  const u32 mask = (1u << log2c) - 1;
  for (u32 h = table_home(pos, log2c);; h = (h + 1) & mask) {
    if (atomicCAS(&tab[h], EMPTY_ENTRY, table_entry(pos, value)) == EMPTY_ENTRY) return;
  }
}

// Index of the entry of `pos`, or -1. Only the value halves may change while lookups run.
__device__ int table_find(const u64* tab, int log2c, int pos) {
  const u32 mask = (1u << log2c) - 1;
  for (u32 h = table_home(pos, log2c);; h = (h + 1) & mask) {
    const u64 cur = tab[h];
    if (entry_holds(cur, pos)) return (int)h;
    if (cur == EMPTY_ENTRY) return -1;
  }
}

// Calls f(i, j, active) for the elements of the request's batch rows rows[0 .. n_rows), in request order
// (row-major, rows ascending). Every thread calls f once per block-wide chunk (active is false past the
// end of a row), so f may run block-wide scans. i * K + j is the element's flat index, which grows in
// request order.
template <class F>
__device__ __forceinline__ void for_each_element(const int* rows, int n_rows, int K, F f) {
  for (int o = 0; o < n_rows; ++o) {
    const int i = rows[o];
    for (int j0 = 0; j0 < K; j0 += blockDim.x) {
      const int j = j0 + threadIdx.x;
      f(i, j, j < K);
    }
  }
}

// resolve(topk, row_state, g, layers) of SPEC.md for one index group, all requests in one launch.
//
// grid = R (one CTA per batch row), RESOLVE_THREADS threads. The CTA of a request's first batch row
// resolves the request over all its rows; the CTAs of its other rows exit at once, those of padding rows
// write -1. Dynamic shared memory, with C = 1 << log2c:
//   u64 tab[C]                 hash table of positions (phase A: first occurrences; then the table of U)
//   int upos[H]                the positions of U in order; later the positions of the misses in order
//   int eslot[H]               E[0 .. |M|): the slots the misses take
//   u32 hit_bits[ceil(H / 32)] slots of hits
//   int rows[R]                the request's batch rows
// The launcher picks C >= max(2 * H, 2 * blockDim). A request whose distinct valid positions exceed C / 2
// leaves the hash for an exact, slower path of windows of C positions.
//
// layers holds 2 * L addresses: GPU slabs of the call's layers, then their host pools (pinned memory,
// read in place through unified addressing). If miss_plan is not null, the pairs (GPU row, host row) of
// the misses are written there for replay: the request's m-th miss goes to batch row (its o-th row, where
// o = m / K) at column m % K, and miss_count[i] is the number of pairs in batch row i.
//
// Nothing here waits for the host, and every output is independent of thread scheduling: the hash table's
// layout may vary, but what it answers does not, and all state of request r is written by its CTA alone.
extern "C" __global__ void __launch_bounds__(RESOLVE_THREADS, 1)
    hisparse_resolve(const int* __restrict__ topk, const int* __restrict__ row_state,
                     const int* __restrict__ seq_lens, const int* __restrict__ block_table,
                     const int* __restrict__ host_table, const int* __restrict__ hot_blocks,
                     int* __restrict__ hot_pos, int* __restrict__ hot_lru, int* __restrict__ heat,
                     int* __restrict__ status, u64* __restrict__ counters, const u64* __restrict__ layers,
                     int* __restrict__ out, i64* __restrict__ miss_plan, int* __restrict__ miss_count, int R,
                     int K, int P, int G, int H, int HB, int g, int L, int bs, int rb, int log2c) {
  extern __shared__ u64 smem[];
  __shared__ int warp_sums[32];
  __shared__ int s_claimed, s_full, s_nu, s_hits;

  const int C = 1 << log2c;
  u64* tab = smem;
  int* upos = (int*)(tab + C);
  int* eslot = upos + H;
  u32* hit_bits = (u32*)(eslot + H);
  int* rows = (int*)(hit_bits + (H + 31) / 32);

  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int i0 = blockIdx.x;
  const int r = row_state[i0];
  if (r < 0) {
    for (int j = tid; j < K; j += nt) out[(i64)i0 * K + j] = -1;
    if (miss_count != nullptr && tid == 0) miss_count[i0] = 0;
    return;
  }
  bool not_first = false;
  for (int k = tid; k < i0; k += nt) not_first |= row_state[k] == r;
  if (__syncthreads_or(not_first)) return;
  int n_rows = 0;
  for (int k0 = i0; k0 < R; k0 += nt) {
    const bool mine = k0 + tid < R && row_state[k0 + tid] == r;
    int total;
    const int o = n_rows + block_exclusive_scan(mine, &total, warp_sums);
    if (mine) rows[o] = k0 + tid;
    n_rows += total;
  }

  const int seq_len = seq_lens[r];
  const int* bt_row = block_table + (i64)r * P;
  const int* ht_row = host_table + (i64)r * P;
  const int* hb_row = hot_blocks + (i64)r * HB;
  int* heat_row = heat + (i64)r * P;
  int* hp = hot_pos + ((i64)r * G + g) * H;
  int* lru = hot_lru + ((i64)r * G + g) * H;

  // -1 for padding and for positions outside [0, seq_len).
  auto position = [&](int i, int j, bool active) {
    const int pos = active ? topk[(i64)i * K + j] : -1;
    return pos >= 0 && pos < seq_len ? pos : -1;
  };
  auto hot_row = [&](int slot) { return (i64)hb_row[slot / bs] * bs + slot % bs; };

  // Phase A: heat of every distinct valid position, and U (distinct non-resident positions in order of
  // first occurrence) into upos. First occurrence = the element whose flat index is the smallest of its
  // position's.
  for (int k = tid; k < C; k += nt) tab[k] = EMPTY_ENTRY;
  if (tid == 0) {
    s_claimed = 0;
    s_full = 0;
    s_nu = 0;
    s_hits = 0;
  }
  __syncthreads();  // also publishes rows
  for_each_element(rows, n_rows, K, [&](int i, int j, bool active) {
    const int pos = position(i, j, active);
    if (pos >= 0 && !table_insert_min(tab, log2c, pos, (u32)(i * K + j), &s_claimed, C / 2)) s_full = 1;
  });
  __syncthreads();

  int n;  // |U|; upos holds U when n <= H
  if (!s_full) {
    n = 0;
    for_each_element(rows, n_rows, K, [&](int i, int j, bool active) {
      const int pos = position(i, j, active);
      bool in_u = false;
      if (pos >= 0 && (u32)tab[table_find(tab, log2c, pos)] == (u32)(i * K + j)) {
        atomicAdd(&heat_row[pos / bs], 1);
        in_u = bt_row[pos / bs] == 0;
      }
      int total;
      const int t = n + block_exclusive_scan(in_u, &total, warp_sums);
      if (in_u && t < H) upos[t] = pos;
      n += total;
    });
  } else {
    // More distinct positions than the table holds: take the positions in windows of C, where a
    // direct-mapped array of first flat indices needs no probing, and order U afterwards by rank.
    u32* first_at = (u32*)tab;      // C words: bytes [0, 4C) of tab
    u64* found = tab + C / 2;       // C / 2 >= H entries (flat << 32 | pos): bytes [4C, 8C)
    for (int w = 0; w < seq_len; w += C) {
      for (int k = tid; k < C; k += nt) first_at[k] = NO_VALUE;
      __syncthreads();
      for_each_element(rows, n_rows, K, [&](int i, int j, bool active) {
        const int pos = position(i, j, active);
        if (pos >= w && pos - w < C) atomicMin(&first_at[pos - w], (u32)(i * K + j));
      });
      __syncthreads();
      for_each_element(rows, n_rows, K, [&](int i, int j, bool active) {
        const int pos = position(i, j, active);
        if (pos >= w && pos - w < C && first_at[pos - w] == (u32)(i * K + j)) {
          atomicAdd(&heat_row[pos / bs], 1);
          if (bt_row[pos / bs] == 0) {
            const int t = atomicAdd(&s_nu, 1);
            if (t < H) found[t] = ((u64)(u32)(i * K + j) << 32) | (u32)pos;
          }
        }
      });
      __syncthreads();
    }
    n = s_nu;
    if (n <= H) {
      for (int a = tid; a < n; a += nt) {
        const u64 key = found[a];
        int rank = 0;
        for (int b = 0; b < n; ++b) rank += found[b] < key;
        upos[rank] = (int)(u32)key;
      }
    }
    __syncthreads();
  }

  const bool overflow = n > H || (n > 0 && hb_row[0] == 0);
  bool ok = n > 0 && !overflow;
  bool no_host = false;
  int n_miss = 0;
  if (ok) {
    // Phase B: the table now maps each position of U to its hit slot (NO_VALUE for a miss).
    for (int k = tid; k < C; k += nt) tab[k] = EMPTY_ENTRY;
    for (int k = tid; k < (H + 31) / 32; k += nt) hit_bits[k] = 0;
    __syncthreads();
    for (int t = tid; t < n; t += nt) table_insert_new(tab, log2c, upos[t], NO_VALUE);
    __syncthreads();
    int my_hits = 0;
    for (int s = tid; s < H; s += nt) {
      const int p = hp[s];
      const int e = p >= 0 ? table_find(tab, log2c, p) : -1;
      if (e >= 0) {
        tab[e] = table_entry(p, (u32)s);  // one slot per position: no other writer
        atomicOr(&hit_bits[s >> 5], 1u << (s & 31));
        ++my_hits;
      }
    }
    if (my_hits > 0) atomicAdd(&s_hits, my_hits);
    __syncthreads();
    for (int t = tid; t < n; t += nt) {
      const int pos = upos[t];
      no_host |= (u32)tab[table_find(tab, log2c, pos)] == NO_VALUE && ht_row[pos / bs] < 0;
    }
    no_host = __syncthreads_or(no_host);
    ok = !no_host;
    if (ok) n_miss = n - s_hits;
  }

  if (ok) {
    // Phase C, the LRU: E = old LRU without the hit slots. E[0 .. |M|) go to eslot; E[|M| ..) move to the
    // front, in place: an entry moves to an index no larger than its own, and each chunk is read
    // completely before it is written (the scan's barrier).
    int e_base = 0;
    for (int k0 = 0; k0 < H; k0 += nt) {
      const int k = k0 + tid;
      int s = 0;
      bool evictable = false;
      if (k < H) {
        s = lru[k];
        evictable = !((hit_bits[s >> 5] >> (s & 31)) & 1);
      }
      int total;
      const int e = e_base + block_exclusive_scan(evictable, &total, warp_sums);
      if (evictable) {
        if (e < n_miss) {
          eslot[e] = s;
        } else {
          lru[e - n_miss] = s;
        }
      }
      e_base += total;
    }

    // Phase D: U in order. Miss m takes slot E[m]; every slot of U goes to the LRU tail in U's order;
    // upos[m] becomes the position of miss m (m <= t, and upos[t] of this chunk was read before the scan).
    int m_base = 0;
    for (int t0 = 0; t0 < n; t0 += nt) {
      const int t = t0 + tid;
      int pos = 0;
      int e = 0;
      u32 slot = 0;
      bool miss = false;
      if (t < n) {
        pos = upos[t];
        e = table_find(tab, log2c, pos);
        slot = (u32)tab[e];
        miss = slot == NO_VALUE;
      }
      int total;
      const int m = m_base + block_exclusive_scan(miss, &total, warp_sums);
      if (miss) {
        slot = (u32)eslot[m];
        tab[e] = table_entry(pos, slot);
        hp[slot] = pos;
        upos[m] = pos;
      }
      if (t < n) lru[H - n + t] = (int)slot;
      m_base += total;
    }
    __syncthreads();

    // Phase E: the misses' rows, for every layer of the call.
    const int nv = rb >> 4;
    copy_chunks((i64)n_miss * L * nv, tid, nt, [&](i64 q, const uint4** src, uint4** dst) {
      const int c = (int)(q % nv);
      const i64 job = q / nv;
      const int m = (int)(job % n_miss);
      const int l = (int)(job / n_miss);
      const int pos = upos[m];
      const i64 host_row = (i64)ht_row[pos / bs] * bs + pos % bs;
      *src = (const uint4*)(layers[L + l] + host_row * rb) + c;
      *dst = (uint4*)(layers[l] + hot_row(eslot[m]) * rb) + c;
      return true;
    });
  }

  if (miss_plan != nullptr) {
    for (int o = 0; o < n_rows; ++o) {
      const int i = rows[o];
      const int count = min(max(n_miss - o * K, 0), K);
      for (int q = tid; q < count; q += nt) {
        const int m = o * K + q;
        const int pos = upos[m];
        i64* pair = miss_plan + ((i64)i * K + q) * 2;
        pair[0] = hot_row(eslot[m]);
        pair[1] = (i64)ht_row[pos / bs] * bs + pos % bs;
      }
      if (tid == 0) miss_count[i] = count;
    }
  }

  // Phase F: row ids. The table answers the slot of every position of U.
  for_each_element(rows, n_rows, K, [&](int i, int j, bool active) {
    if (!active) return;
    const int pos = position(i, j, active);
    int row = -1;
    if (pos >= 0) {
      const int block = bt_row[pos / bs];
      if (block != 0) {
        row = block * bs + pos % bs;
      } else if (ok) {
        row = (int)hot_row((int)(u32)tab[table_find(tab, log2c, pos)]);
      }
    }
    out[(i64)i * K + j] = row;
  });

  if (tid == 0) {
    if (overflow) {
      status[r] |= 1;
    } else if (no_host) {
      status[r] |= 2;
    }
    if (ok) {
      const int n_hit = n - n_miss;
      atomicAdd(&counters[0], (u64)n_hit);
      atomicAdd(&counters[1], (u64)n_miss);
      atomicAdd(&counters[2], (u64)n_miss * (u64)rb * (u64)L);
    }
  }
}

// invalidate(pairs) of SPEC.md. grid = (n, G), 256 threads. The CTA of the first pair of a state row
// handles all pairs of that row for group blockIdx.y, in pair order. Dynamic shared memory: int
// emptied[min(H, n)] (emptied slots in pair order), then u32 bits[ceil(H / 32)] (the same slots as a set).
// A pair with a negative position matches no slot: only empty slots hold -1.
extern "C" __global__ void __launch_bounds__(256)
    hisparse_invalidate(const int* __restrict__ pairs, int n, int* __restrict__ hot_pos,
                        int* __restrict__ hot_lru, int G, int H) {
  extern __shared__ int emptied[];
  __shared__ int warp_sums[32];
  __shared__ int s_found;

  const int tid = threadIdx.x;
  const int nt = blockDim.x;
  const int p = blockIdx.x;
  const int g = blockIdx.y;
  const int r = pairs[2 * p];
  if (r < 0) return;
  bool not_first = false;
  for (int k = tid; k < p; k += nt) not_first |= pairs[2 * k] == r;
  if (__syncthreads_or(not_first)) return;

  u32* bits = (u32*)(emptied + min(H, n));
  int* hp = hot_pos + ((i64)r * G + g) * H;
  int* lru = hot_lru + ((i64)r * G + g) * H;
  for (int k = tid; k < (H + 31) / 32; k += nt) bits[k] = 0;

  int n_emptied = 0;
  for (int q = p; q < n; ++q) {
    const int pos = pairs[2 * q + 1];
    if (pairs[2 * q] != r || pos < 0) continue;
    if (tid == 0) s_found = -1;
    __syncthreads();
    for (int s = tid; s < H; s += nt) {
      if (hp[s] == pos) s_found = s;  // at most one slot holds a position
    }
    __syncthreads();
    const int s = s_found;
    if (s >= 0) {
      if (tid == 0) {
        hp[s] = -1;
        emptied[n_emptied] = s;
        bits[s >> 5] |= 1u << (s & 31);
      }
      ++n_emptied;
    }
    __syncthreads();  // s_found is reset next, and the next search must see hp[s] == -1
  }
  if (n_emptied == 0) return;

  // Kept slots slide to the back in their order, from the last chunk to the first: an entry moves to an
  // index no smaller than its own, and each chunk is read completely before it is written.
  int kept_above = 0;
  for (int k_end = H; k_end > 0; k_end -= nt) {
    const int k = k_end - 1 - tid;
    int s = 0;
    bool keep = false;
    if (k >= 0) {
      s = lru[k];
      keep = !((bits[s >> 5] >> (s & 31)) & 1);
    }
    int total;
    const int above = kept_above + block_exclusive_scan(keep, &total, warp_sums);
    if (keep) lru[H - 1 - above] = s;
    kept_above += total;
  }
  for (int e = tid; e < n_emptied; e += nt) lru[e] = emptied[e];
}
