//! Read-only views for metrics, logs and tests.

use super::*;

impl ResidencyManager {
    pub fn contains(&self, id: u64) -> bool {
        self.requests.contains_key(&id)
    }

    pub fn request_info(&self, id: u64) -> Result<RequestInfo> {
        let r = self.req(id)?;
        Ok(RequestInfo {
            row: r.row(),
            seq_len: r.seq_len,
            residency: r.residency(self.cfg.tail_pages),
            num_pages: r.pages.len() as u32,
            host_only_pages: r.host_only,
            released_pages: r.released,
            hot_blocks: r.hot.as_ref().map_or(0, |h| h.len() as u32),
        })
    }

    /// The request's block table as (GPU block or 0, durable host block or -1) per page.
    pub fn block_table(&self, id: u64) -> Result<Vec<(u32, i32)>> {
        let entries = self.req(id)?.pages.iter().map(|p| p.state.table_entry());
        Ok(entries.map(|e| (e.gpu_block, e.host_block)).collect())
    }

    pub fn page_states(&self, id: u64) -> Result<Vec<&'static str>> {
        Ok(self.req(id)?.pages.iter().map(|p| p.state.name()).collect())
    }

    pub fn hot_blocks(&self, id: u64) -> Result<Vec<BlockId>> {
        Ok(self.req(id)?.hot.clone().unwrap_or_default())
    }

    pub fn request_ids(&self) -> Vec<u64> {
        let mut ids: Vec<u64> = self.requests.keys().copied().collect();
        ids.sort_unstable_by_key(|id| self.requests[id].order);
        ids
    }

    /// How many requests could run at once in steady state: each keeps its tail and a hot region on the
    /// GPU, and reserves its pages at max_model_len on the host.
    pub fn steady_state_concurrency(&self) -> u32 {
        let per_request =
            if self.cfg.policy.tiers() { self.cfg.min_gpu_footprint() } else { self.cfg.max_pages() };
        let gpu = (self.cfg.num_gpu_blocks - 1 - self.cfg.watermark) / per_request;
        let host = self.cfg.num_host_blocks / self.cfg.max_pages();
        gpu.min(host).min(self.cfg.max_running)
    }

    pub fn stats(&self) -> Stats {
        let mut s = self.stats.clone();
        s.gpu_blocks = self.cfg.num_gpu_blocks;
        s.gpu_free = self.pool.num_free();
        s.gpu_used = self.cfg.num_gpu_blocks - 1 - s.gpu_free;
        s.gpu_released = self.pool.num_released();
        s.host_blocks = self.host.num_blocks();
        s.host_referenced = self.host.num_referenced();
        s.host_cached = self.host.num_cached();
        s.host_reserved = self.host.reserved();
        s.pending_transfers = self.copies.len() as u32;
        s.steady_state_concurrency = self.steady_state_concurrency();
        for r in self.requests.values() {
            if r.row().is_none() {
                s.preempted += 1;
                continue;
            }
            s.running += 1;
            s.gpu_hot += r.hot.as_ref().map_or(0, |h| h.len() as u32);
            match r.residency(self.cfg.tail_pages) {
                Residency::Full => s.full += 1,
                Residency::Mixed => s.mixed += 1,
                Residency::None => s.none += 1,
            }
        }
        s
    }

    /// One line for logs, in the spirit of vLLM's KV cache capacity line, with the host pool included.
    pub fn capacity_log(&self) -> String {
        let s = self.stats();
        let gib = |blocks: u64| blocks as f64 * self.cfg.page_bytes as f64 / (1u64 << 30) as f64;
        format!(
            "hisparse: GPU {used}/{total} blocks used ({hot} hot, {rel} released, {free} free); host {href}/{htot} \
             blocks referenced ({hgib:.2}/{htgib:.2} GiB, {hc} cached); running {run} (full {f}, mixed {m}, none {n}), \
             preempted {p}; {pend} copies in flight; steady-state concurrency {ss}",
            used = s.gpu_used,
            total = s.gpu_blocks - 1,
            hot = s.gpu_hot,
            rel = s.gpu_released,
            free = s.gpu_free,
            href = s.host_referenced,
            htot = s.host_blocks,
            hgib = gib(s.host_referenced as u64),
            htgib = gib(s.host_blocks as u64),
            hc = s.host_cached,
            run = s.running,
            f = s.full,
            m = s.mixed,
            n = s.none,
            p = s.preempted,
            pend = s.pending_transfers,
            ss = s.steady_state_concurrency,
        )
    }
}
