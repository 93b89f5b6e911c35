//! Selection heat: which pages the indexer keeps choosing, so that pressure releases the others first.
//!
//! The resolver counts on the device, once per distinct selected position, `heat[row, page] += 1`
//! (`cuda/SPEC.md`). Nothing crosses to the scheduler per step. Every `heat_interval` steps the worker
//! runs [`summarize`]: for each request it reports its `candidates` coldest *releasable* pages (clean,
//! outside the tail, as the plan's table updates flag them) as a [`HeatSummary`], and then halves every
//! count. The scheduler keeps the latest summary per request and releases in its order.
//!
//! The decay rule, and why: a page's heat is an exponentially weighted count of its selections with a
//! half-life of one interval (`h <- floor(h / 2)` after each summary). The indexer's choices drift as a
//! request grows (the recent window moves, topics change), so old selections must stop protecting a page:
//! a page selected `h` times long ago is back to 0 after `log2(h) + 1` intervals and goes first again.
//! Halving is one shift per page per interval, it needs no clock on the device, and a summary taken right
//! before the shift ranks by what was selected since the last one plus a fading memory of the past.
//!
//! Cost: the summary scans each running row's pages once per interval (one pass, a partial selection),
//! and the scheduler stores `candidates` pairs per request: O(candidates / interval) per request and step,
//! flat in context length on the scheduler side.

use crate::codec;
use crate::error::{invalid, Result};

/// A ranking of some requests' releasable pages: for request `requests[i]`, entries `offsets[i] ..
/// offsets[i + 1]` of `pages` / `heat`; the first `cold[i]` of them are its coldest pages, the rest its
/// hottest, each part in ascending `(heat, page)` order, no page twice. The policy releases the coldest
/// first, the pages it was not told about next (oldest first), the hottest last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeatSummary {
    pub requests: Vec<u64>,
    pub offsets: Vec<u32>,
    pub cold: Vec<u32>,
    pub pages: Vec<u32>,
    pub heat: Vec<u32>,
}

const MAGIC: u32 = u32::from_le_bytes(*b"HSHT");
const VERSION: u32 = 2;

impl Default for HeatSummary {
    fn default() -> Self {
        HeatSummary {
            requests: Vec::new(),
            offsets: vec![0],
            cold: Vec::new(),
            pages: Vec::new(),
            heat: Vec::new(),
        }
    }
}

impl HeatSummary {
    /// Appends a request's coldest and hottest `(heat, page)` pairs, each put in ranking order.
    pub fn push(&mut self, request: u64, mut coldest: Vec<(u32, u32)>, mut hottest: Vec<(u32, u32)>) {
        coldest.sort_unstable();
        hottest.sort_unstable();
        self.requests.push(request);
        self.cold.push(coldest.len() as u32);
        for (h, p) in coldest.into_iter().chain(hottest) {
            self.heat.push(h);
            self.pages.push(p);
        }
        self.offsets.push(self.pages.len() as u32);
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    fn part(&self, a: usize, b: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.heat[a..b].iter().copied().zip(self.pages[a..b].iter().copied())
    }

    /// The `(heat, page)` pairs of the `i`-th request's coldest pages, coldest first.
    pub fn coldest(&self, i: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
        let a = self.offsets[i] as usize;
        self.part(a, a + self.cold[i] as usize)
    }

    /// The `(heat, page)` pairs of the `i`-th request's hottest pages, the least hot first.
    pub fn hottest(&self, i: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
        self.part(self.offsets[i] as usize + self.cold[i] as usize, self.offsets[i + 1] as usize)
    }

    /// Checks the shape promised above.
    pub fn validate(&self) -> Result<()> {
        let n = self.requests.len();
        if self.offsets.len() != n + 1 || self.offsets.first() != Some(&0) || self.cold.len() != n {
            return invalid(format!(
                "a heat summary of {n} requests needs {} offsets starting at 0 and {n} cold counts, not {} and {}",
                n + 1,
                self.offsets.len(),
                self.cold.len()
            ));
        }
        let end = *self.offsets.last().expect("non-empty") as usize;
        if self.pages.len() != self.heat.len() || end != self.pages.len() {
            return invalid(format!(
                "a heat summary's offsets end at {end} but it has {} pages and {} heat values",
                self.pages.len(),
                self.heat.len()
            ));
        }
        if self.offsets.windows(2).any(|w| w[0] > w[1]) {
            return invalid("a heat summary's offsets must not decrease");
        }
        let mut seen = std::collections::HashSet::with_capacity(n);
        let mut pages: Vec<u32> = Vec::new();
        for (i, &id) in self.requests.iter().enumerate() {
            if !seen.insert(id) {
                return invalid(format!("request {id} appears twice in one heat summary"));
            }
            if self.cold[i] > self.offsets[i + 1] - self.offsets[i] {
                return invalid(format!("request {id} has more cold pages than entries"));
            }
            let ascending = |part: Vec<(u32, u32)>| part.windows(2).all(|w| w[0] < w[1]);
            if !ascending(self.coldest(i).collect()) || !ascending(self.hottest(i).collect()) {
                return invalid(format!(
                    "request {id}'s coldest and hottest pages must each be in ascending (heat, page) order"
                ));
            }
            pages.clear();
            pages.extend_from_slice(&self.pages[self.offsets[i] as usize..self.offsets[i + 1] as usize]);
            pages.sort_unstable();
            if pages.windows(2).any(|w| w[0] == w[1]) {
                return invalid(format!("request {id} lists a page twice in one heat summary"));
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        let words = 4 + self.offsets.len() + self.cold.len() + 2 * self.pages.len();
        let mut w = codec::Writer::with_capacity(4 * words + 8 * self.len() + 8);
        for v in [MAGIC, VERSION, self.requests.len() as u32, self.pages.len() as u32] {
            w.u32(v);
        }
        self.offsets.iter().chain(&self.cold).chain(&self.pages).chain(&self.heat).for_each(|&v| w.u32(v));
        w.align8();
        self.requests.iter().for_each(|&id| w.u64(id));
        w.finish()
    }

    /// The inverse of [`Self::encode`], validated.
    pub fn decode(buf: &[u8]) -> Result<HeatSummary> {
        let mut r = codec::Reader::new(buf, "heat summary", MAGIC, VERSION)?;
        let (n, total) = (r.count(4)?, r.count(2)?);
        let mut words = |k: usize| (0..k).map(|_| r.u32()).collect::<Result<Vec<_>>>();
        let (offsets, cold, pages, heat) = (words(n + 1)?, words(n)?, words(total)?, words(total)?);
        r.align8()?;
        let requests = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
        r.finish()?;
        let summary = HeatSummary { requests, offsets, cold, pages, heat };
        summary.validate()?;
        Ok(summary)
    }
}

/// The worker's tables the summary reads, `S` rows of `P` pages, flat row-major.
pub struct HeatTables<'a> {
    pub seq_lens: &'a [i32],
    /// 1 where the page may be released (the plans' table updates keep it).
    pub releasable: &'a [u8],
    /// The request each row serves (its id's bits), meaningful while the row's length is positive.
    pub row_request: &'a [i64],
    pub heat: &'a mut [i32],
}

/// Heat values are counted exactly up to this; hotter pages share the last bucket of the histogram (and
/// are then ranked by their exact value).
const BUCKETS: usize = 1024;

/// One row's ranking: the `coldest` smallest and then the `hottest` largest `(heat, page)` pairs of its
/// releasable pages, found with a histogram of the heat (two passes, no sort of the whole row).
struct RowRanker {
    histogram: Vec<u32>,
    cold: Vec<(u32, u32)>,
    hot: Vec<(u32, u32)>,
    ties: Vec<(u32, u32)>,
}

impl RowRanker {
    fn new() -> Self {
        RowRanker { histogram: vec![0; BUCKETS], cold: Vec::new(), hot: Vec::new(), ties: Vec::new() }
    }

    /// `heat` and `releasable` of one row's used pages; halves the row's counts (`decay`, the whole row)
    /// after reading them.
    fn rank(&mut self, heat: &mut [i32], used: usize, releasable: &[u8], coldest: usize, hottest: usize) {
        let bucket = |h: i32| (h.max(0) as usize).min(BUCKETS - 1);
        self.histogram.iter_mut().for_each(|c| *c = 0);
        let mut eligible = 0usize;
        for (&h, &ok) in heat[..used].iter().zip(releasable) {
            if ok != 0 {
                self.histogram[bucket(h)] += 1;
                eligible += 1;
            }
        }
        let n_cold = coldest.min(eligible);
        let n_hot = hottest.min(eligible - n_cold);
        // The bucket where the coldest run out (`cold_at`, with `cold_room` of its pages taken) and where the
        // hottest run out from the top (`hot_at`, `hot_room`).
        let (mut cold_at, mut cold_room, mut below) = (BUCKETS, 0usize, 0usize);
        for (b, &c) in self.histogram.iter().enumerate() {
            if below + c as usize >= n_cold {
                (cold_at, cold_room) = (b, n_cold - below);
                break;
            }
            below += c as usize;
        }
        let (mut hot_at, mut hot_room, mut above) = (BUCKETS, 0usize, 0usize);
        for (b, &c) in self.histogram.iter().enumerate().rev() {
            if above + c as usize >= n_hot {
                (hot_at, hot_room) = (b, n_hot - above);
                break;
            }
            above += c as usize;
        }
        self.cold.clear();
        self.hot.clear();
        self.ties.clear();
        let mut hot_ties: Vec<(u32, u32)> = Vec::new();
        for (page, (h, &ok)) in heat[..used].iter_mut().zip(releasable).enumerate() {
            if ok != 0 {
                let e = ((*h).max(0) as u32, page as u32);
                let b = bucket(*h);
                if b < cold_at {
                    self.cold.push(e);
                } else if b == cold_at {
                    self.ties.push(e);
                }
                if b > hot_at {
                    self.hot.push(e);
                } else if b == hot_at {
                    hot_ties.push(e);
                }
            }
            *h = (*h).max(0) >> 1;
        }
        heat[used..].iter_mut().for_each(|h| *h = (*h).max(0) >> 1);
        // A tie bucket below the last holds one heat value, collected in page order: ranked already. The
        // last bucket holds every larger value: sort it.
        if cold_at == BUCKETS - 1 {
            self.ties.sort_unstable();
        }
        // Below the tie bucket the coldest (fewer than asked for) came in page order: rank them, then the ties.
        self.cold.sort_unstable();
        self.cold.extend_from_slice(&self.ties[..cold_room]);
        if hot_at == BUCKETS - 1 {
            hot_ties.sort_unstable();
        }
        // The hottest take the top of their tie bucket, the coldest its bottom: together they are at most
        // the bucket (n_hot <= eligible - n_cold), so they never meet.
        self.hot.extend_from_slice(&hot_ties[hot_ties.len() - hot_room..]);
        self.hot.sort_unstable();
    }
}

/// `heat_summary` of SPEC.md: the `coldest` coldest and then the `hottest` hottest releasable pages of
/// every row that serves a request (a positive length), then every count of those rows halved (the whole
/// row). Counts below 0 (never written by a resolver) read as 0.
pub fn summarize(
    t: &mut HeatTables<'_>,
    pages: usize,
    block_size: usize,
    coldest: usize,
    hottest: usize,
) -> Result<HeatSummary> {
    let s = t.seq_lens.len();
    if t.row_request.len() != s
        || t.releasable.len() != s * pages
        || t.heat.len() != s * pages
        || block_size == 0
    {
        return invalid(format!(
            "heat tables must be [S] and [S, P] with S = {s}, P = {pages} and a positive block size"
        ));
    }
    let mut out = HeatSummary::default();
    let mut ranker = RowRanker::new();
    // A row serves a request while its length is positive; `row_request` holds the id's bits (u64::MAX
    // reads as -1, the value of a free row, hence the length).
    for r in (0..s).filter(|&r| t.seq_lens[r] > 0) {
        let used = (t.seq_lens[r] as usize).div_ceil(block_size).min(pages);
        let row = r * pages..(r + 1) * pages;
        ranker.rank(&mut t.heat[row.clone()], used, &t.releasable[row], coldest, hottest);
        out.push(t.row_request[r] as u64, ranker.cold.clone(), ranker.hot.clone());
    }
    Ok(out)
}

/// The summary of a device that ranked on its own: `cold_keys[r, i] = heat * pages + page` of row `r`'s
/// `i`-th coldest releasable page (`cold_counts[r]` valid), `hot_keys[r, i]` of its `i`-th hottest
/// (`hot_counts[r]` valid, hottest first; those among the coldest are dropped). Rows whose `seq_lens` entry
/// is 0 serve no request.
pub struct RankedKeys<'a> {
    pub cold_keys: &'a [i64],
    pub cold_counts: &'a [i64],
    pub hot_keys: &'a [i64],
    pub hot_counts: &'a [i64],
    pub row_request: &'a [i64],
    pub seq_lens: &'a [i32],
}

pub fn from_ranked_keys(
    k: &RankedKeys<'_>,
    pages: usize,
    coldest: usize,
    hottest: usize,
) -> Result<HeatSummary> {
    let s = k.seq_lens.len();
    if k.cold_keys.len() != s * coldest
        || k.hot_keys.len() != s * hottest
        || k.cold_counts.len() != s
        || k.hot_counts.len() != s
        || k.row_request.len() != s
        || pages == 0
    {
        return invalid(format!(
            "ranked keys must be [S, {coldest}] and [S, {hottest}], counts, requests and lengths [S] with S = {s}"
        ));
    }
    let entry = |key: i64, r: usize| -> Result<(u32, u32)> {
        let (heat, page) = (key.div_euclid(pages as i64), key.rem_euclid(pages as i64));
        match u32::try_from(heat) {
            Ok(heat) => Ok((heat, page as u32)),
            Err(_) => invalid(format!("ranked key {key} of row {r} holds no heat of a page")),
        }
    };
    let mut out = HeatSummary::default();
    for r in (0..s).filter(|&r| k.seq_lens[r] > 0) {
        let n_cold = k.cold_counts[r].clamp(0, coldest as i64) as usize;
        let cold = k.cold_keys[r * coldest..r * coldest + n_cold].iter().map(|&key| entry(key, r));
        let cold = cold.collect::<Result<Vec<_>>>()?;
        let n_hot = k.hot_counts[r].clamp(0, hottest as i64) as usize;
        let mut hot = Vec::with_capacity(n_hot);
        for &key in &k.hot_keys[r * hottest..r * hottest + n_hot] {
            let e = entry(key, r)?;
            if !cold.contains(&e) {
                hot.push(e);
            }
        }
        out.push(k.row_request[r] as u64, cold, hot);
    }
    out.validate()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    type Ranking = (Vec<(u32, u32)>, Vec<(u32, u32)>);

    /// The ranking by definition: sort everything.
    fn brute(heat: &[i32], releasable: &[u8], used: usize, coldest: usize, hottest: usize) -> Ranking {
        let mut all: Vec<(u32, u32)> =
            (0..used).filter(|&p| releasable[p] != 0).map(|p| (heat[p].max(0) as u32, p as u32)).collect();
        all.sort_unstable();
        let n_cold = coldest.min(all.len());
        let n_hot = hottest.min(all.len() - n_cold);
        (all[..n_cold].to_vec(), all[all.len() - n_hot..].to_vec())
    }

    #[test]
    fn coldest_and_hottest_releasable_pages_then_halved() {
        // Two rows of 6 pages, block size 2. Row 0 serves request 7 and has 5 pages (9 tokens).
        let seq_lens = [9, 0];
        let releasable = [1, 1, 0, 1, 1, 1, /* */ 0, 0, 0, 0, 0, 0];
        let row_request = [7, -1];
        let mut heat = [4, 0, 0, 3, 0, 9, /* */ 0, 0, 0, 0, 0, 0];
        let mut t = HeatTables {
            seq_lens: &seq_lens,
            releasable: &releasable,
            row_request: &row_request,
            heat: &mut heat,
        };
        let s = summarize(&mut t, 6, 2, 2, 1).unwrap();
        // Page 2 is not releasable, page 5 is beyond the request's 5 pages: pages 0, 1, 3, 4 are ranked.
        assert_eq!(s.requests, [7]);
        assert_eq!(s.coldest(0).collect::<Vec<_>>(), [(0, 1), (0, 4)]);
        assert_eq!(s.hottest(0).collect::<Vec<_>>(), [(4, 0)]);
        assert_eq!(heat[..6], [2, 0, 0, 1, 0, 4]);
        s.validate().unwrap();
        assert_eq!(HeatSummary::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn the_histogram_ranks_as_sorting_everything_does() {
        // Ties in one bucket, values beyond the last bucket, fewer pages than asked for, both parts meeting.
        let mut seed = 12345u64;
        let mut next = || {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) as u32
        };
        for case in 0..400 {
            let pages = 1 + next() as usize % 300;
            let used = 1 + next() as usize % pages;
            let spread = [1, 3, 50, 5000][case % 4];
            let heat: Vec<i32> =
                (0..pages).map(|_| (next() % spread) as i32 - (case % 7 == 0) as i32).collect();
            let releasable: Vec<u8> = (0..pages).map(|_| (next() % 4 != 0) as u8).collect();
            let (coldest, hottest) = (next() as usize % 40, next() as usize % 40);
            let mut ranker = RowRanker::new();
            let mut h = heat.clone();
            ranker.rank(&mut h, used, &releasable, coldest, hottest);
            let mut hot = ranker.hot.clone();
            hot.sort_unstable();
            assert_eq!(
                (ranker.cold.clone(), hot),
                brute(&heat, &releasable, used, coldest, hottest),
                "case {case}"
            );
            assert!(h.iter().zip(&heat).all(|(&after, &before)| after == before.max(0) >> 1));
        }
    }

    #[test]
    fn decode_refuses_a_malformed_summary() {
        let mut good = HeatSummary::default();
        good.push(1, vec![(1, 2), (1, 3)], vec![(9, 5)]);
        good.validate().unwrap();
        assert_eq!(HeatSummary::decode(&good.encode()).unwrap(), good);
        let unordered = HeatSummary { heat: vec![2, 1, 9], ..good.clone() };
        assert!(HeatSummary::decode(&unordered.encode()).is_err());
        let twice = HeatSummary { pages: vec![2, 3, 2], ..good.clone() };
        assert!(twice.validate().is_err());
        let too_cold = HeatSummary { cold: vec![4], ..good.clone() };
        assert!(too_cold.validate().is_err());
        let ragged = HeatSummary { heat: vec![1], ..good.clone() };
        assert!(ragged.validate().is_err());
        let mut again = good.clone();
        again.push(1, vec![], vec![]);
        assert!(again.validate().is_err());
    }

    #[test]
    fn decode_accepts_only_what_encode_writes() {
        // 13 words before the request ids: 4 bytes of padding, which must stay zero.
        let mut good = HeatSummary::default();
        good.push(1, vec![(1, 2), (1, 3)], vec![(9, 5)]);
        codec::assert_one_encoding(&good.encode(), |b| HeatSummary::decode(b).ok().map(|s| s.encode()));
    }
}
