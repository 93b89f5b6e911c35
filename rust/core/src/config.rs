//! Configuration of one residency manager, validated once at construction.

use crate::error::{CoreError, Result};
use crate::pool_policy::worth_transition;

/// Which pages go first when the GPU pool runs short.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PressurePolicy {
    /// Release the pages the indexer selects least (lowest reported heat, ties to the oldest page), and only
    /// transition a request to mixed residency when that frees more blocks than its hot region costs.
    Coldest,
    /// vLLM 0.33's behaviour: a transitioned request releases every clean page it has, newest first, and
    /// released blocks are reused in the order they were released.
    Fifo,
    /// No hierarchy at all (the baseline): pages are never released and nobody holds a hot region; a
    /// request that comes back from the host (prefix hit or resumption) has every page restored whole.
    Resident,
}

impl PressurePolicy {
    pub fn name(&self) -> &'static str {
        match self {
            PressurePolicy::Coldest => "coldest",
            PressurePolicy::Fifo => "fifo",
            PressurePolicy::Resident => "resident",
        }
    }

    /// Whether requests may read through hot regions (and so may release pages).
    pub fn tiers(&self) -> bool {
        *self != PressurePolicy::Resident
    }
}

impl std::str::FromStr for PressurePolicy {
    type Err = CoreError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "coldest" => Ok(PressurePolicy::Coldest),
            "fifo" => Ok(PressurePolicy::Fifo),
            "resident" => Ok(PressurePolicy::Resident),
            other => Err(CoreError::Config(format!(
                "unknown policy {other:?}: expected 'coldest', 'fifo' or 'resident'"
            ))),
        }
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    /// GPU blocks including the null block 0.
    pub num_gpu_blocks: u32,
    /// Host blocks in the pinned host pool.
    pub num_host_blocks: u32,
    /// Tokens per block (page).
    pub block_size: u32,
    pub max_model_len: u32,
    /// Request state rows: the most requests that can run at once.
    pub max_running: u32,
    pub top_k: u32,
    /// Hot rows per request (per index group); each group keeps its own slot mapping in the same blocks.
    pub hot_rows: u32,
    /// Index groups: sets of layers that share one top-K.
    pub num_index_groups: u32,
    /// The newest pages that are never released.
    pub tail_pages: u32,
    /// Free GPU blocks the pressure policy keeps.
    pub watermark: u32,
    pub policy: PressurePolicy,
    /// Page copies planned per step at most, in each direction (to the host proactively; back to the GPU
    /// when pressure is gone and a request returns to full residency).
    pub materialize_budget: u32,
    /// Bytes of one page for all layers, for stats and logs.
    pub page_bytes: u64,
    /// Resident pages admission reserves for a request (vLLM's `max_admission_blocks_per_request`, one
    /// window of `max_num_batched_tokens`); 0: none. A tiered request that never fills it comes back from the
    /// host resident ([`Self::returns_resident`]).
    pub admission_pages: u32,
}

impl Config {
    /// The default hot rows: `2 * top_k` without speculation (room for a step's misses beside the rows
    /// the indexer keeps selecting), `(q + 1) * top_k` with `q` speculative tokens, whose verification
    /// rows resolve together.
    pub fn default_hot_rows(top_k: u32, speculative_tokens: u32) -> Result<u32> {
        speculative_tokens.saturating_add(1).max(2).checked_mul(top_k).ok_or_else(|| {
            CoreError::Config(format!(
                "{speculative_tokens} speculative tokens x top_k {top_k} overflows hot_rows"
            ))
        })
    }

    pub fn hot_blocks(&self) -> u32 {
        self.hot_rows.div_ceil(self.block_size)
    }

    pub fn max_pages(&self) -> u32 {
        self.max_model_len.div_ceil(self.block_size)
    }

    /// The default watermark: one hot region or a tenth of the pool, whichever is larger.
    pub fn default_watermark(num_gpu_blocks: u32, hot_blocks: u32) -> u32 {
        hot_blocks.max(num_gpu_blocks / 10)
    }

    /// The fewest GPU blocks a running request can be squeezed to: its tail and its hot region.
    pub fn min_gpu_footprint(&self) -> u32 {
        self.footprint(self.policy.tiers())
    }

    /// The blocks a running request keeps at least: its tail, and with `hot` its hot region.
    fn footprint(&self, hot: bool) -> u32 {
        let hot_rows = if hot { self.hot_rows } else { 0 };
        // A zero block size is refused by validate(); until then, count it as no footprint.
        steady_state_blocks(0, self.block_size, hot_rows, self.tail_pages, 1)
            .map_or(0, |b| b.min(u32::MAX as u64) as u32)
    }

    /// The blocks a running request of `max_len` tokens keeps in reserve: its tail, and a hot region if it
    /// can ever take one ([`Self::tiered`]). Admission reserves it, leaving gives it back, the audit sums it.
    pub fn request_footprint(&self, max_len: u32) -> u32 {
        self.footprint(self.tiered(max_len))
    }

    /// Whether a request of `max_len` tokens can ever read through a hot region: only where releasing every
    /// page outside its tail would free more blocks than the region costs (the test pressure applies before
    /// a move). One that cannot is served as plain residency serves it: restored whole, keeping its tail.
    pub fn tiered(&self, max_len: u32) -> bool {
        let pages = max_len.div_ceil(self.block_size.max(1)) as usize;
        let outside_tail = pages.saturating_sub(self.tail_pages as usize);
        self.policy.tiers() && worth_transition(outside_tail, 1, self.hot_blocks() as usize)
    }

    /// Whether a tiered request of `max_len` tokens that comes back from the host (a prefix hit, a
    /// resumption) is restored whole rather than given a hot region: one that never fills its admission
    /// window, which vLLM keeps resident until pressure makes a move pay (`PoolShape::transition`), as a
    /// fresh request of that length runs. Admission already wants its window's blocks free; through a hot
    /// region its prefill would read its host-only history over the host link inside its steps (a chunk's
    /// selections together cover it), where restored whole the same bytes land before it runs.
    pub fn returns_resident(&self, max_len: u32) -> bool {
        max_len.div_ceil(self.block_size.max(1)) < self.admission_pages
    }

    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(CoreError::Config(m));
        if self.block_size == 0 || self.top_k == 0 || self.hot_rows == 0 || self.max_model_len == 0 {
            return bad("block_size, top_k, hot_rows and max_model_len must be positive".into());
        }
        // Bookkeeping is a few bytes per block: beyond this a typo would exhaust memory before any error.
        const MAX_BLOCKS: u32 = 1 << 28;
        if self.num_gpu_blocks > MAX_BLOCKS || self.num_host_blocks > MAX_BLOCKS || self.max_running > 1 << 20
        {
            return bad(format!(
                "pools are limited to {MAX_BLOCKS} blocks and 2^20 running requests (got {} GPU, {} host, {} running)",
                self.num_gpu_blocks, self.num_host_blocks, self.max_running
            ));
        }
        if self.page_bytes > 1 << 40 {
            return bad(format!("page_bytes ({}) is more than a TiB for one page: a typo?", self.page_bytes));
        }
        if self.num_index_groups == 0 || self.max_running == 0 {
            return bad("num_index_groups and max_running must be positive".into());
        }
        if self.materialize_budget == 0 {
            return bad(
                "materialize_budget must be positive: with no page copied to the host, no page could ever \
                        be released"
                    .into(),
            );
        }
        if self.hot_rows < self.top_k {
            return bad(format!(
                "hot_rows ({}) is smaller than top_k ({}): one decode step could never fit; raise hot_rows",
                self.hot_rows, self.top_k
            ));
        }
        if self.tail_pages == 0 {
            return bad("tail_pages must be at least 1: the page being written must stay on the GPU".into());
        }
        let need = 1 + self.min_gpu_footprint() as u64 + self.watermark as u64;
        if (self.num_gpu_blocks as u64) < need {
            let hot = if self.policy.tiers() { self.hot_blocks() } else { 0 };
            return bad(format!(
                "num_gpu_blocks ({}) cannot back one request: it needs the null block, {} tail pages, a hot \
                 region of {hot} blocks and a watermark of {} blocks = {need}; raise the GPU pool or lower hot_rows",
                self.num_gpu_blocks, self.tail_pages, self.watermark
            ));
        }
        if self.num_host_blocks < self.max_pages() {
            let size = |blocks: u32| match self.page_bytes {
                0 => format!("{blocks} blocks"),
                bytes => format!(
                    "{blocks} blocks, {} GiB",
                    gib_text(blocks as f64 * bytes as f64 / (1u64 << 30) as f64)
                ),
            };
            return bad(format!(
                "the host pool ({}) cannot hold one request at max_model_len {}; raise it (num_host_blocks or \
                 host_pool_gib) to at least {} or lower max_model_len",
                size(self.num_host_blocks),
                self.max_model_len,
                size(self.max_pages())
            ));
        }
        if self.max_pages() > i32::MAX as u32 / self.block_size.max(1)
            || self.num_gpu_blocks > i32::MAX as u32
        {
            return bad("the pools are too large for int32 row ids".into());
        }
        Ok(())
    }
}

/// What a caller chooses; [`Options::build`] fills in the defaults and validates. The defaults are
/// decisions of the core (hot rows from top-K and speculation, the watermark from the pool), so they live
/// here and not in a binding.
#[derive(Clone, Debug)]
pub struct Options {
    pub num_gpu_blocks: u32,
    pub max_model_len: u32,
    pub block_size: u32,
    /// Exactly one of `num_host_blocks` and `host_pool_gib` (which needs `page_bytes`).
    pub num_host_blocks: Option<u32>,
    pub host_pool_gib: Option<f64>,
    pub page_bytes: u64,
    pub max_running: u32,
    pub top_k: u32,
    /// Default: [`Config::default_hot_rows`].
    pub hot_rows: Option<u32>,
    pub speculative_tokens: u32,
    pub num_index_groups: u32,
    pub tail_pages: u32,
    /// Default: [`Config::default_watermark`] (a hot region counted only when the policy tiers).
    pub watermark: Option<u32>,
    pub policy: PressurePolicy,
    pub materialize_budget: u32,
    /// Default 0: no admission window ([`Config::admission_pages`]).
    pub admission_pages: u32,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            num_gpu_blocks: 0,
            max_model_len: 0,
            block_size: 64,
            num_host_blocks: None,
            host_pool_gib: None,
            page_bytes: 0,
            max_running: 256,
            top_k: 2048,
            hot_rows: None,
            speculative_tokens: 0,
            num_index_groups: 1,
            tail_pages: 2,
            watermark: None,
            policy: PressurePolicy::Coldest,
            materialize_budget: 256,
            admission_pages: 0,
        }
    }
}

impl Options {
    pub fn build(&self) -> Result<Config> {
        let bad = |m: String| Err(CoreError::Config(m));
        let num_host_blocks = match (self.num_host_blocks, self.host_pool_gib) {
            (Some(n), None) => n,
            (None, Some(gib)) if self.page_bytes > 0 && gib.is_finite() && gib > 0.0 => {
                let blocks = gib * (1u64 << 30) as f64 / self.page_bytes as f64;
                if blocks > u32::MAX as f64 {
                    return bad(format!(
                        "host_pool_gib {gib} is {blocks:.0} blocks of {} bytes: too many",
                        self.page_bytes
                    ));
                }
                blocks as u32
            }
            (None, Some(gib)) => {
                return bad(format!(
                    "host_pool_gib ({gib}) needs a positive, finite size and a positive page_bytes"
                ))
            }
            _ => return bad("give exactly one of num_host_blocks and host_pool_gib".into()),
        };
        let hot_rows = match self.hot_rows {
            Some(rows) => rows,
            None => Config::default_hot_rows(self.top_k, self.speculative_tokens)?,
        };
        // Without tiers nobody leases a hot region, so it does not size the watermark.
        let hot_blocks =
            if self.policy.tiers() && self.block_size > 0 { hot_rows.div_ceil(self.block_size) } else { 0 };
        let cfg = Config {
            num_gpu_blocks: self.num_gpu_blocks,
            num_host_blocks,
            block_size: self.block_size,
            max_model_len: self.max_model_len,
            max_running: self.max_running,
            top_k: self.top_k,
            hot_rows,
            num_index_groups: self.num_index_groups,
            tail_pages: self.tail_pages,
            watermark: self
                .watermark
                .unwrap_or_else(|| Config::default_watermark(self.num_gpu_blocks, hot_blocks)),
            policy: self.policy,
            materialize_budget: self.materialize_budget,
            page_bytes: self.page_bytes,
            admission_pages: self.admission_pages,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// GPU blocks one request holds in steady state under pressure: its resident index keys (one block per page
/// of `seq_len`, when the indexer's keys live in blocks of their own; pass 0 when they do not) and, per block
/// group, its tail pages and a hot region.
///
/// hisparse keeps every layer of a page in one block, so one group serves all index groups: its own
/// footprint is `steady_state_blocks(0, .., groups = 1)`. An allocator that gives each group of layers its own
/// blocks (vLLM's hybrid allocator, 20 groups for GLM-5.3) pays tail and hot region once per group.
pub fn steady_state_blocks(
    seq_len: u64,
    block_size: u32,
    hot_rows: u32,
    tail_pages: u32,
    groups: u32,
) -> Option<u64> {
    let bs = block_size as u64;
    let per_group = (tail_pages as u64)
        .checked_add((hot_rows as u64).checked_div(bs)? + (hot_rows as u64 % bs != 0) as u64)?;
    seq_len.div_ceil(bs).checked_add((groups as u64).checked_mul(per_group)?)
}

#[cfg(test)]
pub(crate) fn test_config(num_gpu_blocks: u32, num_host_blocks: u32) -> Config {
    Config {
        num_gpu_blocks,
        num_host_blocks,
        block_size: 4,
        max_model_len: 64,
        max_running: 8,
        top_k: 4,
        hot_rows: 8,
        num_index_groups: 2,
        tail_pages: 2,
        watermark: 2,
        policy: PressurePolicy::Coldest,
        materialize_budget: 64,
        page_bytes: 4096,
        admission_pages: 0,
    }
}

/// GiB with two decimals, or two significant digits below 0.01 (a test-sized pool is not "0.00 GiB").
fn gib_text(gib: f64) -> String {
    if gib >= 0.01 || gib == 0.0 {
        format!("{gib:.2}")
    } else {
        format!("{gib:.1e}")
    }
}
