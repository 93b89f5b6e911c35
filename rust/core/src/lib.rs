//! hisparse-core: the residency bookkeeping of hybrid sparse-attention KV caching, and a bit-exact CPU
//! reference of the GPU data path. No Python here; `hisparse-python` binds it.
//!
//! - [`block_pool`], [`host_pool`]: the GPU and pinned-host block pools.
//! - [`page`]: the page state machine and derived request residency.
//! - [`page_set`]: a request's set of pages, one bit each.
//! - [`manager`]: admission, the per-step plan, pressure policy, proactive copies, prefix reuse.
//! - [`pool_policy`]: release and reuse order over a block pool another engine owns (vLLM).
//! - [`block_rows`]: that engine's per-request block rows, recorded as it changes them, and its per-step scans.
//! - [`page_book`]: that engine's page lifecycle (copies to the host, clean, released and lost pages, the GPU
//!   copies a prefix hit adopts), its effects asked of the engine.
//! - [`slab`]: values found by name, or through a handle kept from one step to the next.
//! - [`heat`]: selection heat, summarized and decayed on the worker, ranked by the pressure policy.
//! - [`lru_stamps`]: the hot region's LRU as stamps (the rules `reference` follows), proven against the
//!   permutation it replaced.
//! - [`reference`]: the CPU specification of every kernel in `cuda/` (see `cuda/SPEC.md`).
//! - [`worker`]: applying a step plan to a worker's state, slab and host pool.

pub mod block_pool;
pub mod block_rows;
mod codec;
pub mod config;
pub mod error;
pub mod heat;
pub mod host_pool;
mod ids;
mod index_list;
pub mod lru_stamps;
pub mod manager;
pub mod page;
pub mod page_book;
pub mod page_set;
pub mod plan;
pub mod pool_policy;
pub mod reference;
pub mod slab;
pub mod worker;

pub use config::{steady_state_blocks, Config, Options, PressurePolicy};
pub use error::{CoreError, Resource, Result};
pub use heat::HeatSummary;
pub use manager::{Admission, RequestInfo, ResidencyManager, Stats};
pub use page::{PageState, Residency};
pub use plan::StepPlan;
