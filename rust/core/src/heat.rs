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

/// The coldest releasable pages of some requests, coldest first: request `requests[i]` owns entries
/// `offsets[i] .. offsets[i + 1]` of `pages` / `heat`, in ascending `(heat, page)` order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HeatSummary {
    pub requests: Vec<u64>,
    pub offsets: Vec<u32>,
    pub pages: Vec<u32>,
    pub heat: Vec<u32>,
}

const MAGIC: u32 = u32::from_le_bytes(*b"HSHT");
const VERSION: u32 = 1;

impl Default for HeatSummary {
    fn default() -> Self {
        HeatSummary { requests: Vec::new(), offsets: vec![0], pages: Vec::new(), heat: Vec::new() }
    }
}

impl HeatSummary {
    /// Appends a request's `(heat, page)` pairs, putting them in ranking order.
    pub fn push(&mut self, request: u64, mut entries: Vec<(u32, u32)>) {
        entries.sort_unstable();
        self.requests.push(request);
        self.heat.extend(entries.iter().map(|&(h, _)| h));
        self.pages.extend(entries.iter().map(|&(_, p)| p));
        self.offsets.push(self.pages.len() as u32);
    }

    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// The `(heat, page)` pairs of the `i`-th request, coldest first.
    pub fn entries(&self, i: usize) -> impl Iterator<Item = (u32, u32)> + '_ {
        let (a, b) = (self.offsets[i] as usize, self.offsets[i + 1] as usize);
        self.heat[a..b].iter().copied().zip(self.pages[a..b].iter().copied())
    }

    /// Checks the shape promised above: offsets that partition the entries, each request once, each
    /// request's pages distinct and in `(heat, page)` order.
    pub fn validate(&self) -> Result<()> {
        if self.offsets.len() != self.requests.len() + 1 || self.offsets.first() != Some(&0) {
            return invalid(format!(
                "a heat summary of {} requests needs {} offsets starting at 0, not {}",
                self.requests.len(),
                self.requests.len() + 1,
                self.offsets.len()
            ));
        }
        if self.pages.len() != self.heat.len()
            || *self.offsets.last().expect("non-empty") as usize != self.pages.len()
        {
            return invalid(format!(
                "a heat summary's offsets end at {} but it has {} pages and {} heat values",
                self.offsets.last().expect("non-empty"),
                self.pages.len(),
                self.heat.len()
            ));
        }
        if self.offsets.windows(2).any(|w| w[0] > w[1]) {
            return invalid("a heat summary's offsets must not decrease");
        }
        let mut seen = std::collections::HashSet::with_capacity(self.requests.len());
        for (i, &id) in self.requests.iter().enumerate() {
            if !seen.insert(id) {
                return invalid(format!("request {id} appears twice in one heat summary"));
            }
            let mut prev: Option<(u32, u32)> = None;
            for e in self.entries(i) {
                if prev.is_some_and(|p| p >= e) {
                    return invalid(format!(
                        "request {id}'s heat entries must be distinct pages in ascending (heat, page) order"
                    ));
                }
                prev = Some(e);
            }
            let pages = &self.pages[self.offsets[i] as usize..self.offsets[i + 1] as usize];
            let mut sorted = pages.to_vec();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return invalid(format!("request {id} lists a page twice in one heat summary"));
            }
        }
        Ok(())
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = codec::Writer::with_capacity(
            16 + 4 * (self.offsets.len() + 2 * self.pages.len()) + 8 * self.len() + 8,
        );
        for v in [MAGIC, VERSION, self.requests.len() as u32, self.pages.len() as u32] {
            w.u32(v);
        }
        self.offsets.iter().chain(&self.pages).chain(&self.heat).for_each(|&v| w.u32(v));
        w.align8();
        self.requests.iter().for_each(|&id| w.u64(id));
        w.finish()
    }

    /// The inverse of [`Self::encode`], validated.
    pub fn decode(buf: &[u8]) -> Result<HeatSummary> {
        let mut r = codec::Reader::new(buf, "heat summary", MAGIC, VERSION)?;
        let (n, total) = (r.count(3)?, r.count(2)?);
        let mut words = |k: usize| (0..k).map(|_| r.u32()).collect::<Result<Vec<_>>>();
        let (offsets, pages, heat) = (words(n + 1)?, words(total)?, words(total)?);
        r.align8()?;
        let requests = (0..n).map(|_| r.u64()).collect::<Result<Vec<_>>>()?;
        r.finish()?;
        let summary = HeatSummary { requests, offsets, pages, heat };
        summary.validate()?;
        Ok(summary)
    }
}

/// The worker's tables the summary reads, `S` rows of `P` pages, flat row-major.
pub struct HeatTables<'a> {
    pub seq_lens: &'a [i32],
    /// 1 where the page may be released (the plans' table updates keep it).
    pub releasable: &'a [u8],
    /// The request each row serves, -1 for a free row.
    pub row_request: &'a [i64],
    pub heat: &'a mut [i32],
}

/// `heat_summary` of SPEC.md: the `candidates` coldest releasable pages of every row that serves a
/// request (a positive length), then every count of those rows halved (the whole row). Counts below 0 (never written by a
/// resolver) read as 0.
pub fn summarize(
    t: &mut HeatTables<'_>,
    pages: usize,
    block_size: usize,
    candidates: usize,
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
    let mut ranked: Vec<(u32, u32)> = Vec::new();
    // A row serves a request while its length is positive; `row_request` holds the id's bits (u64::MAX
    // reads as -1, the value of a free row, hence the length).
    for r in (0..s).filter(|&r| t.seq_lens[r] > 0) {
        let request = t.row_request[r] as u64;
        let used = (t.seq_lens[r] as usize).div_ceil(block_size).min(pages);
        let row = r * pages..r * pages + used;
        ranked.clear();
        ranked.extend(
            t.heat[row.clone()]
                .iter()
                .zip(&t.releasable[row.clone()])
                .enumerate()
                .filter(|(_, (_, &ok))| ok != 0)
                .map(|(page, (&h, _))| (h.max(0) as u32, page as u32)),
        );
        if ranked.len() > candidates {
            ranked.select_nth_unstable(candidates);
            ranked.truncate(candidates);
        }
        ranked.sort_unstable();
        out.requests.push(request);
        out.heat.extend(ranked.iter().map(|&(h, _)| h));
        out.pages.extend(ranked.iter().map(|&(_, p)| p));
        out.offsets.push(out.pages.len() as u32);
        t.heat[r * pages..(r + 1) * pages].iter_mut().for_each(|h| *h = (*h).max(0) >> 1);
    }
    Ok(out)
}

/// The summary of a device that ranked on its own: `keys[r, i] = heat * pages + page` of row `r`'s `i`-th
/// coldest releasable page, `counts[r]` of them valid. Rows whose `seq_lens` entry is 0 serve no request.
pub fn from_ranked_keys(
    keys: &[i64],
    counts: &[i64],
    row_request: &[i64],
    seq_lens: &[i32],
    pages: usize,
    k: usize,
) -> Result<HeatSummary> {
    let s = seq_lens.len();
    if keys.len() != s * k || counts.len() != s || row_request.len() != s || pages == 0 {
        return invalid(format!(
            "ranked keys must be [S, {k}] and counts, requests, lengths [S] with S = {s}"
        ));
    }
    let mut out = HeatSummary::default();
    for r in (0..s).filter(|&r| seq_lens[r] > 0) {
        let n = counts[r].clamp(0, k as i64) as usize;
        let mut entries = Vec::with_capacity(n);
        for &key in &keys[r * k..r * k + n] {
            let (heat, page) = (key.div_euclid(pages as i64), key.rem_euclid(pages as i64));
            let Ok(heat) = u32::try_from(heat) else {
                return invalid(format!("ranked key {key} of row {r} holds no heat of a page"));
            };
            entries.push((heat, page as u32));
        }
        out.push(row_request[r] as u64, entries);
    }
    out.validate()?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coldest_releasable_first_then_halved() {
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
        let s = summarize(&mut t, 6, 2, 3).unwrap();
        // Page 2 is not releasable, page 5 is beyond the request's 5 pages; the 3 coldest of 0, 1, 3, 4.
        assert_eq!(s.requests, [7]);
        assert_eq!(s.entries(0).collect::<Vec<_>>(), [(0, 1), (0, 4), (3, 3)]);
        assert_eq!(heat[..6], [2, 0, 0, 1, 0, 4]);
        s.validate().unwrap();
        assert_eq!(HeatSummary::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn decode_refuses_a_malformed_summary() {
        let bad = HeatSummary { requests: vec![1], offsets: vec![0, 2], pages: vec![2, 3], heat: vec![1, 1] };
        assert!(bad.validate().is_ok());
        let unordered = HeatSummary { heat: vec![2, 1], ..bad.clone() };
        assert!(HeatSummary::decode(&unordered.encode()).is_err());
        let twice = HeatSummary { requests: vec![1, 1], offsets: vec![0, 1, 2], ..bad.clone() };
        assert!(twice.validate().is_err());
        let ragged = HeatSummary { heat: vec![1], ..bad };
        assert!(ragged.validate().is_err());
    }
}
