//! The page lifecycle of an engine that owns its block ids (vLLM 0.33's HiSparse), kept here: per request,
//! which pages are being copied to the host, which are clean (their host copy complete), which clean pages
//! still hold their GPU blocks and which were released to the pool; the host copies in flight; the GPU
//! blocks each released page is still read from; and the GPU copies of published host pages that a later
//! prefix hit can adopt.
//!
//! vLLM's coordinator keeps this in Python dicts and sets and walks them page by page and group by group
//! (six resident groups on DeepSeek-V3.2) at every event of a page's life. The same transitions run here
//! over integers, in vLLM's order, with every effect on vLLM's own objects (its pools, its managers' rows,
//! its host prefix cache) asked of an [`Engine`] at the point vLLM makes it: the engine stays the one
//! allocator and the one owner of its rows and prefix cache.
//!
//! A page moves `dirty -> copying -> clean -> released -> lost`:
//! - *copying*: a transfer to its host block is in flight ([`PageBook::plan`]); the transfer pins the page's
//!   GPU blocks and its host block until the workers report it.
//! - *clean*: the transfer completed ([`PageBook::update_transfers`]), or the page came from a host prefix.
//!   A clean page outside the request's tail is released once the request reads through its hot region:
//!   its blocks go back to the pool ([`Engine::unpin`]) but keep being read until the pool reuses them.
//! - *lost*: the pool handed a released page's block to another request ([`PageBook::block_reused`]): the
//!   request reads the page from the host from then on.
//!
//! A request's record lives from its first bookkeeping to [`PageBook::free`]; a freed request's record stays
//! while its transfers are in flight (vLLM's detached state: a finished request's prefix is published once
//! its last copies complete).

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use crate::block_rows::{BlockRows, Row, HOST_ONLY};
use crate::error::CoreError;
use crate::page_set::PageSet;

/// Pages at the end of a request's rows that stay pinned whatever their state (vLLM's `ACTIVE_TAIL_PAGES`):
/// the pages its next steps write.
pub const TAIL_PAGES: usize = 2;

pub type TransferId = u64;

/// A published host block's prefix-cache key (vLLM's `BlockHashWithGroupId` bytes).
pub type Hash = Arc<[u8]>;

/// What the book asks of the engine that owns the blocks, rows and prefix cache, at the point vLLM's
/// coordinator would make the same call. Block ids are the engine's; a host block id is never
/// [`HOST_ONLY`] when passed.
pub trait Engine {
    /// A pending publication's arguments, as the engine passes them back (vLLM's request and its options).
    type Payload;
    type Error: From<CoreError>;

    /// Takes a reference to each GPU block (a transfer's pins, an adopted copy).
    fn touch_gpu(&mut self, blocks: &[u32]) -> Result<(), Self::Error>;
    fn touch_host(&mut self, blocks: &[u32]) -> Result<(), Self::Error>;
    /// Gives back a completed transfer's pins on its GPU blocks.
    fn release_pins(&mut self, blocks: &[u32]) -> Result<(), Self::Error>;
    /// Gives back host blocks, in this order.
    fn free_host(&mut self, blocks: &[u32]) -> Result<(), Self::Error>;
    /// Releases GPU blocks to the pool while they are still read: the pool tells [`PageBook::block_reused`]
    /// when it hands one out.
    fn unpin(&mut self, blocks: &[u32]) -> Result<(), Self::Error>;
    /// The prefix-cache key of a host block, if it is published.
    fn host_hash(&mut self, block: u32) -> Result<Option<Hash>, Self::Error>;
    /// Whether the request reads through its hot region (may its resident pages be dropped under it).
    fn can_read_from_host(&mut self, request: &str) -> Result<bool, Self::Error>;
    /// The request reads `page` from the host from now on, in `group` or in every resident group (`None`).
    fn drop_resident_page(
        &mut self,
        request: &str,
        page: u32,
        group: Option<usize>,
    ) -> Result<(), Self::Error>;
    /// Points the request's host-only `page` in `group` at `block`, a GPU copy of it; whether it did.
    fn adopt(&mut self, request: &str, page: u32, group: usize, block: u32) -> Result<bool, Self::Error>;
    /// The request is to be given a hot region (it has lost a page).
    fn require_hot(&mut self, request: &str) -> Result<(), Self::Error>;
    /// Publishes the request's first `tokens` to the host prefix cache.
    fn publish(&mut self, payload: &Self::Payload, tokens: u64) -> Result<(), Self::Error>;
    /// Whether the publication's request has finished (not merely been preempted).
    fn finished(&mut self, payload: &Self::Payload) -> Result<bool, Self::Error>;
    /// The request is freed with copies in flight: its first `pages` host blocks are leased to the
    /// publication until they complete.
    fn detach(&mut self, request: &str, payload: &mut Self::Payload, pages: usize)
        -> Result<(), Self::Error>;
    /// A detached publication's copies completed: publish its first `full_pages` and give back its lease.
    fn publish_detached(&mut self, payload: &Self::Payload, full_pages: usize) -> Result<(), Self::Error>;
    /// The order to release the request's releasable `pages` in (given increasing, at least two): the
    /// policy's (vLLM's: tail first, so a prefix loses its tail pages before its head).
    fn release_order(&mut self, request: &str, pages: Vec<u32>) -> Result<Vec<u32>, Self::Error>;
    /// The order to publish the requests whose copies completed in one report in (given in the order their
    /// first copy completed, at least two): vLLM's is its set's of their names, which two requests sharing a
    /// prefix see (the later one's GPU copies are the ones indexed).
    fn publish_order(&mut self, requests: Vec<Arc<str>>) -> Result<Vec<Arc<str>>, Self::Error>;
    /// The request, `released` of whose pages are released already, does not read through its hot region:
    /// the policy decides whether it asks for one.
    fn without_region(&mut self, request: &str, released: usize) -> Result<(), Self::Error>;
}

/// A pending publication: the request's computed prefix, published as its pages become durable.
#[derive(Clone, Debug)]
struct Publication<P> {
    payload: P,
    computed_tokens: u64,
    pages: usize,
    detached: bool,
}

#[derive(Clone, Debug)]
struct State<P> {
    request: Arc<str>,
    /// Not yet freed (a freed request's record stays while its transfers are in flight).
    live: bool,
    /// Clean pages: their host copy is complete.
    valid: PageSet,
    /// Pages `0..ready_prefix` are all clean: the durable prefix.
    ready_prefix: usize,
    /// Pages being copied, with their transfer.
    copying: BTreeMap<u32, TransferId>,
    publication: Option<Publication<P>>,
    /// The host pages whose GPU copies were indexed for prefix hits (or need none).
    copies_recorded: usize,
    /// Clean pages still holding their GPU blocks.
    pinned_clean: PageSet,
    /// Clean pages released to the pool, still read until it reuses their blocks.
    released: PageSet,
    /// A prefix hit's pages whose GPU copies are adopted after the admitting allocation.
    to_adopt: usize,
    /// The workers hold the request's residency below this page, but for `stale`.
    synced: usize,
    stale: PageSet,
}

impl<P> State<P> {
    fn new(request: Arc<str>) -> Self {
        Self {
            request,
            live: true,
            valid: PageSet::default(),
            ready_prefix: 0,
            copying: BTreeMap::new(),
            publication: None,
            copies_recorded: 0,
            pinned_clean: PageSet::default(),
            released: PageSet::default(),
            to_adopt: 0,
            synced: 0,
            stale: PageSet::default(),
        }
    }

    fn advance_ready_prefix(&mut self) {
        while self.valid.contains(self.ready_prefix as u32) {
            self.ready_prefix += 1;
        }
    }
}

/// A host copy of a page in flight.
#[derive(Clone, Debug)]
struct Transfer {
    state: usize,
    page: u32,
    host: u32,
    resident: Box<[u32]>,
    restore: bool,
    /// Reports the workers will make (0 until the first report says), and made so far.
    expected: u64,
    done: u64,
    /// The GPU pins were given back (every worker enqueued it).
    pins_released: bool,
}

impl Transfer {
    fn reported(&self) -> bool {
        self.expected != 0 && self.done >= self.expected
    }
}

/// A transfer planned and not yet sent to the workers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    pub id: TransferId,
    pub host: u32,
    pub resident: Box<[u32]>,
    pub after_forward: bool,
    pub restore: bool,
}

/// A transfer in flight, as [`PageBook::transfers`] lists it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InFlight {
    pub id: TransferId,
    pub request: Arc<str>,
    pub page: u32,
    pub host: u32,
    pub resident: Box<[u32]>,
    pub pins_released: bool,
    /// Its request's record is the live one (not one freed since it was planned).
    pub live: bool,
    /// Its request finished and its prefix is published once this and its other copies complete.
    pub detached: bool,
}

/// A request's page states, as [`PageBook::pages`] reports them (for checks and tests).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Pages {
    pub valid: Vec<u32>,
    pub ready_prefix: usize,
    pub copying: Vec<(u32, TransferId)>,
    pub pinned_clean: Vec<u32>,
    pub released: Vec<u32>,
    pub stale: Vec<u32>,
    pub synced: usize,
    pub to_adopt: usize,
    pub copies_recorded: usize,
    /// A pending publication's computed tokens and pages.
    pub publication: Option<(u64, usize)>,
}

/// The page lifecycle (module docs). `P` is the engine's publication payload.
#[derive(Clone, Debug)]
pub struct PageBook<P> {
    block_size: u64,
    /// The most transfers planned and not yet sent (vLLM's `max_spill_pages`).
    max_planned: usize,
    states: Vec<Option<State<P>>>,
    free_slots: Vec<usize>,
    live: HashMap<Arc<str>, usize>,
    transfers: BTreeMap<TransferId, Transfer>,
    next_transfer: TransferId,
    planned: Vec<Planned>,
    /// Released GPU block -> the (request, page) pairs still reading it.
    owners: HashMap<u32, Vec<(Arc<str>, u32)>>,
    /// Published host block key -> the GPU blocks (one a resident group) holding a copy of its page.
    copies: HashMap<Hash, Box<[u32]>>,
    copy_by_block: HashMap<u32, Hash>,
    /// Request -> prefix tokens an external load is still writing into its host pages.
    imports: HashMap<Arc<str>, u64>,
}

impl<P> PageBook<P> {
    pub fn new(block_size: u32, max_planned: usize) -> Result<Self, CoreError> {
        if block_size == 0 {
            return Err(CoreError::InvalidArgument("block_size must be positive".into()));
        }
        Ok(Self {
            block_size: u64::from(block_size),
            max_planned,
            states: Vec::new(),
            free_slots: Vec::new(),
            live: HashMap::new(),
            transfers: BTreeMap::new(),
            next_transfer: 0,
            planned: Vec::new(),
            owners: HashMap::new(),
            copies: HashMap::new(),
            copy_by_block: HashMap::new(),
            imports: HashMap::new(),
        })
    }

    // ------------------------------------------------------------------ records

    fn slot(&mut self, request: &str) -> usize {
        if let Some(&slot) = self.live.get(request) {
            return slot;
        }
        let name: Arc<str> = Arc::from(request);
        let state = Some(State::new(name.clone()));
        let slot = match self.free_slots.pop() {
            Some(slot) => {
                self.states[slot] = state;
                slot
            }
            None => {
                self.states.push(state);
                self.states.len() - 1
            }
        };
        self.live.insert(name, slot);
        slot
    }

    fn state(&self, slot: usize) -> &State<P> {
        self.states[slot].as_ref().expect("a slot in use")
    }

    fn state_mut(&mut self, slot: usize) -> &mut State<P> {
        self.states[slot].as_mut().expect("a slot in use")
    }

    fn live_state(&self, request: &str) -> Option<&State<P>> {
        self.live.get(request).map(|&slot| self.state(slot))
    }

    /// Drops a freed request's record once no transfer refers to it.
    fn release_slot_if_done(&mut self, slot: usize) {
        let state = self.state(slot);
        if !state.live && state.copying.is_empty() {
            self.states[slot] = None;
            self.free_slots.push(slot);
        }
    }

    /// Whether `request` has a record (vLLM makes one at its first bookkeeping, and drops it when freed).
    pub fn knows(&self, request: &str) -> bool {
        self.live.contains_key(request)
    }

    pub fn len(&self) -> usize {
        self.live.len()
    }

    pub fn is_empty(&self) -> bool {
        self.live.is_empty()
    }

    pub fn pages(&self, request: &str) -> Option<Pages> {
        let s = self.live_state(request)?;
        Some(Pages {
            valid: s.valid.iter().collect(),
            ready_prefix: s.ready_prefix,
            copying: s.copying.iter().map(|(&page, &id)| (page, id)).collect(),
            pinned_clean: s.pinned_clean.iter().collect(),
            released: s.released.iter().collect(),
            stale: s.stale.iter().collect(),
            synced: s.synced,
            to_adopt: s.to_adopt,
            copies_recorded: s.copies_recorded,
            publication: s.publication.as_ref().map(|p| (p.computed_tokens, p.pages)),
        })
    }

    /// How many of the request's pages are released (0 without a record).
    pub fn released(&self, request: &str) -> usize {
        self.live_state(request).map_or(0, |s| s.released.len())
    }

    /// The live requests.
    pub fn requests(&self) -> impl Iterator<Item = &str> {
        self.live.keys().map(|name| &**name)
    }

    // ------------------------------------------------------------------ prefix hits and imports

    /// The request's first `pages` host pages are a prefix hit it now holds (clean, durable, their GPU copies
    /// to adopt once its admitting allocation has run). `pages` is at most its host row's length.
    pub fn commit_computed(&mut self, request: &str, pages: usize) {
        if pages == 0 {
            return;
        }
        let slot = self.slot(request);
        let s = self.state_mut(slot);
        for page in 0..pages {
            s.valid.insert(page as u32);
        }
        s.ready_prefix = s.ready_prefix.max(pages);
        s.to_adopt = s.to_adopt.max(pages);
        s.copies_recorded = s.copies_recorded.max(pages);
    }

    /// An external load is writing the request's first `tokens` into its host pages.
    pub fn record_import(&mut self, request: &str, tokens: u64) {
        self.imports.insert(Arc::from(request), tokens);
    }

    /// The request's import is no longer being loaded (it completed, failed, or the request was freed).
    pub fn forget_import(&mut self, request: &str) {
        self.imports.remove(request);
    }

    /// The pages an external load is still writing into the request's host row (from the first).
    fn importing_pages(&self, request: &str) -> u64 {
        self.imports.get(request).map_or(0, |&tokens| tokens.div_ceil(self.block_size))
    }

    pub fn import_tokens(&self, request: &str) -> Option<u64> {
        self.imports.get(request).copied()
    }

    pub fn imports(&self) -> impl Iterator<Item = (&str, u64)> {
        self.imports.iter().map(|(name, &tokens)| (&**name, tokens))
    }

    /// The request's first `tokens` were written into its host pages by a load: they are its durable
    /// prefix, the last (partial) page is restored to the GPU, and the prefix is published.
    pub fn complete_import<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
        tokens: u64,
    ) -> Result<(), E::Error> {
        let pages = (tokens / self.block_size) as usize;
        let slot = self.slot(request);
        let s = self.state_mut(slot);
        s.valid = PageSet::default();
        for page in 0..pages {
            s.valid.insert(page as u32);
        }
        s.ready_prefix = pages;
        if tokens > 0 {
            let last = ((tokens - 1) / self.block_size) as u32;
            self.plan(rows, engine, request, last, false, true)?;
        }
        self.publish_if_ready(rows, engine, request)
    }

    // ------------------------------------------------------------------ host copies

    /// Plans the host copy of `page` (a restore copies the other way): false, changing nothing, when it is
    /// being copied already, has no host block, or is not on the GPU in every group.
    pub fn plan<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
        page: u32,
        after_forward: bool,
        restore: bool,
    ) -> Result<bool, E::Error> {
        let slot = self.slot(request);
        if self.state(slot).copying.contains_key(&page) {
            return Ok(false);
        }
        let host = rows.block(request, Row::Host, page as usize);
        let (Some(host), Some(resident)) =
            (host.filter(|&h| h != HOST_ONLY), rows.resident_blocks(request, page as usize))
        else {
            return Ok(false);
        };
        engine.touch_host(&[host])?;
        engine.touch_gpu(&resident)?;
        let id = self.next_transfer;
        self.next_transfer += 1;
        let resident: Box<[u32]> = resident.into();
        self.transfers.insert(
            id,
            Transfer {
                state: slot,
                page,
                host,
                resident: resident.clone(),
                restore,
                expected: 0,
                done: 0,
                pins_released: false,
            },
        );
        self.state_mut(slot).copying.insert(page, id);
        self.planned.push(Planned { id, host, resident, after_forward, restore });
        Ok(true)
    }

    /// vLLM's per-step work for each scheduled `(request, tokens computed once the step has run)`, in order
    /// (its `advance_scheduled`): the host copies of its sealed pages (past the last `reprefill` tokens, not
    /// final yet), the GPU copies of its prefix hit adopted, then its residency: a request reading through
    /// its hot region releases its clean pages out of the tail in the policy's order
    /// ([`Engine::release_order`]); another is left to the policy ([`Engine::without_region`]). Returns how
    /// many pages were released.
    pub fn advance<E: Engine<Payload = P>>(
        &mut self,
        rows: &mut BlockRows,
        engine: &mut E,
        steps: &[(String, u64)],
        reprefill: u64,
    ) -> Result<usize, E::Error> {
        let mut released = 0;
        for (request, tokens) in steps {
            self.materialize(rows, engine, request, tokens.saturating_sub(reprefill))?;
            self.adopt(rows, engine, request, true)?;
            if engine.can_read_from_host(request)? {
                let mut pages = self.releasable(rows, request);
                if pages.len() > 1 {
                    pages = engine.release_order(request, pages)?;
                }
                released += self.unpin(rows, engine, request, &pages)?;
            } else {
                engine.without_region(request, self.released(request))?;
            }
        }
        Ok(released)
    }

    /// Plans the host copy of every sealed page of the first `tokens` that has none yet and is on the GPU
    /// (vLLM's `plan_prefix_materialization`), within the planning budget.
    pub fn materialize<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
        tokens: u64,
    ) -> Result<(), E::Error> {
        let pages = tokens / self.block_size;
        let importing = self.importing_pages(request);
        let slot = self.slot(request);
        let mut budget = self.max_planned.saturating_sub(self.planned.len());
        let first = (self.state(slot).ready_prefix as u64).max(importing);
        for page in first..pages {
            if budget == 0 {
                break;
            }
            let page =
                u32::try_from(page).map_err(|_| CoreError::InvalidArgument("page past 2^32".into()))?;
            let s = self.state(slot);
            if s.copying.contains_key(&page) || s.valid.contains(page) {
                continue;
            }
            if rows.resident_blocks(request, page as usize).is_none() {
                continue;
            }
            if self.plan(rows, engine, request, page, true, false)? {
                budget -= 1;
            }
        }
        Ok(())
    }

    /// The transfers planned since the last call, in order (vLLM's offload command).
    pub fn take_planned(&mut self) -> Vec<Planned> {
        std::mem::take(&mut self.planned)
    }

    pub fn planned(&self) -> usize {
        self.planned.len()
    }

    pub fn in_flight(&self) -> usize {
        self.transfers.len()
    }

    pub fn next_transfer(&self) -> TransferId {
        self.next_transfer
    }

    /// Every transfer in flight, by id.
    pub fn transfers(&self) -> Vec<InFlight> {
        self.transfers
            .iter()
            .map(|(&id, t)| {
                let s = self.state(t.state);
                InFlight {
                    id,
                    request: s.request.clone(),
                    page: t.page,
                    host: t.host,
                    resident: t.resident.clone(),
                    pins_released: t.pins_released,
                    live: s.live,
                    detached: !s.live && s.publication.is_some(),
                }
            })
            .collect()
    }

    /// The workers' reports: per transfer, how many reports to expect (its first report says) and how many
    /// it made. A transfer every worker enqueued gives back its GPU pins; one every worker completed makes
    /// its page clean (released at once when the request reads through its hot region and the page is out
    /// of its tail), gives back its host pin, and publishes what became durable. Unknown ids are ignored.
    pub fn update_transfers<E: Engine<Payload = P>>(
        &mut self,
        rows: &mut BlockRows,
        engine: &mut E,
        enqueued: &[(TransferId, u64)],
        completed: &[(TransferId, u64)],
    ) -> Result<(), E::Error> {
        for &(id, count) in enqueued {
            if let Some(t) = self.transfers.get_mut(&id) {
                if t.expected == 0 {
                    t.expected = count;
                }
            }
        }
        for &(id, count) in completed {
            if let Some(t) = self.transfers.get_mut(&id) {
                t.done += count;
            }
        }
        let enqueued_now: Vec<TransferId> = self
            .transfers
            .iter()
            .filter(|(_, t)| !t.pins_released && t.reported())
            .map(|(&id, _)| id)
            .collect();
        for id in enqueued_now {
            let t = self.transfers.get_mut(&id).expect("listed above");
            t.pins_released = true;
            let pins = t.resident.clone();
            engine.release_pins(&pins)?;
        }
        let done: Vec<TransferId> = self
            .transfers
            .iter()
            .filter(|(_, t)| t.pins_released && t.reported())
            .map(|(&id, _)| id)
            .collect();
        let mut completed_requests: Vec<Arc<str>> = Vec::new();
        for id in done {
            let t = self.transfers.remove(&id).expect("listed above");
            let (slot, page) = (t.state, t.page);
            let s = self.state_mut(slot);
            s.copying.remove(&page);
            let request = s.request.clone();
            if s.live {
                if !t.restore {
                    s.valid.insert(page);
                }
                if s.valid.contains(page) {
                    s.pinned_clean.insert(page);
                    rows.wake(&request);
                    if engine.can_read_from_host(&request)? {
                        self.unpin(rows, engine, &request, &[page])?;
                    }
                    if t.restore {
                        self.record_copy(rows, engine, &request, page, t.host)?;
                    }
                }
                if !completed_requests.contains(&request) {
                    completed_requests.push(request);
                }
            } else if s.publication.is_some() {
                if !t.restore {
                    s.valid.insert(page);
                }
                self.publish_detached(engine, slot)?;
            }
            engine.free_host(&[t.host])?;
            self.release_slot_if_done(slot);
        }
        if completed_requests.len() > 1 {
            completed_requests = engine.publish_order(completed_requests)?;
        }
        for request in completed_requests {
            let Some(&slot) = self.live.get(&request) else { continue };
            self.state_mut(slot).advance_ready_prefix();
            self.publish_if_ready(rows, engine, &request)?;
        }
        Ok(())
    }

    fn publish_detached<E: Engine<Payload = P>>(
        &mut self,
        engine: &mut E,
        slot: usize,
    ) -> Result<(), E::Error> {
        let s = self.state_mut(slot);
        if !s.copying.is_empty() || !s.publication.as_ref().is_some_and(|p| p.detached) {
            return Ok(());
        }
        s.advance_ready_prefix();
        let full = s.ready_prefix;
        let publication = s.publication.take().expect("checked above");
        engine.publish_detached(&publication.payload, full.min(publication.pages))
    }

    // ------------------------------------------------------------------ publication

    /// The request's computed prefix is to be published as its pages become durable (vLLM's
    /// `publish_when_ready`): `None` drops a pending publication without publishing.
    pub fn set_publication(&mut self, request: &str, publication: Option<(P, u64)>) {
        let block_size = self.block_size;
        let slot = self.slot(request);
        self.state_mut(slot).publication = publication.map(|(payload, computed_tokens)| Publication {
            payload,
            computed_tokens,
            pages: (computed_tokens / block_size) as usize,
            detached: false,
        });
    }

    /// The durable prefix and the host pages whose GPU copies are indexed, of a request with a record.
    pub fn publication_facts(&self, request: &str) -> Option<(usize, usize)> {
        self.live_state(request).map(|s| (s.ready_prefix, s.copies_recorded))
    }

    /// Publishes the durable part of the request's pending publication, and indexes the GPU copies of the
    /// pages it published; the publication ends once all of it is durable.
    pub fn publish_if_ready<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
    ) -> Result<(), E::Error> {
        let Some(&slot) = self.live.get(request) else { return Ok(()) };
        let s = self.state(slot);
        let Some(publication) = &s.publication else { return Ok(()) };
        let tokens = publication.computed_tokens.min(s.ready_prefix as u64 * self.block_size);
        engine.publish(&publication.payload, tokens)?;
        self.record_copies(rows, engine, request, slot, tokens)?;
        let s = self.state_mut(slot);
        if s.publication.as_ref().is_some_and(|p| s.ready_prefix >= p.pages) {
            s.publication = None;
        }
        Ok(())
    }

    fn record_copies<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
        slot: usize,
        tokens: u64,
    ) -> Result<(), E::Error> {
        let host_pages = rows.row_len(request, Row::Host).map_err(E::Error::from)?;
        if host_pages == 0 {
            return Ok(());
        }
        let pages = ((tokens / self.block_size) as usize).min(host_pages);
        for page in self.state(slot).copies_recorded..pages {
            if self.state(slot).copying.contains_key(&(page as u32)) {
                continue;
            }
            if let Some(host) = rows.block(request, Row::Host, page) {
                self.record_copy(rows, engine, request, page as u32, host)?;
            }
        }
        let s = self.state_mut(slot);
        s.copies_recorded = s.copies_recorded.max(pages);
        Ok(())
    }

    /// Indexes the GPU blocks of the request's `page` as the copy of its published host block.
    fn record_copy<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
        page: u32,
        host: u32,
    ) -> Result<(), E::Error> {
        if host == HOST_ONLY {
            return Ok(());
        }
        let Some(hash) = engine.host_hash(host)? else { return Ok(()) };
        let Some(blocks) = rows.resident_blocks(request, page as usize) else { return Ok(()) };
        self.drop_copy(&hash);
        for &block in &blocks {
            self.copy_by_block.insert(block, hash.clone());
        }
        self.copies.insert(hash, blocks.into());
        Ok(())
    }

    fn drop_copy(&mut self, hash: &Hash) {
        if let Some(blocks) = self.copies.remove(hash) {
            for block in blocks.iter() {
                self.copy_by_block.remove(block);
            }
        }
    }

    /// The GPU blocks indexed as the copy of the host block keyed `hash`.
    pub fn copy_of(&self, hash: &[u8]) -> Option<&[u32]> {
        self.copies.get(hash).map(|blocks| &**blocks)
    }

    pub fn copies(&self) -> impl Iterator<Item = (&Hash, &[u32])> {
        self.copies.iter().map(|(hash, blocks)| (hash, &**blocks))
    }

    /// The copy index's inverse: each indexed GPU block and the key of the copy it holds.
    pub fn copy_keys(&self) -> impl Iterator<Item = (u32, &Hash)> {
        self.copy_by_block.iter().map(|(&block, hash)| (block, hash))
    }

    // ------------------------------------------------------------------ residency

    /// Adopts, for each of the request's prefix-hit pages (those [`commit_computed`] left to adopt), the GPU
    /// copy indexed for its host block, group by group: the page is then resident, clean and pinned.
    ///
    /// [`commit_computed`]: PageBook::commit_computed
    /// `done` ends the adoption (vLLM's per-step residency does; a whole restore adopts first and leaves
    /// that to it).
    pub fn adopt<E: Engine<Payload = P>>(
        &mut self,
        rows: &mut BlockRows,
        engine: &mut E,
        request: &str,
        done: bool,
    ) -> Result<usize, E::Error> {
        let slot = self.slot(request);
        let to_adopt = self.state(slot).to_adopt;
        if to_adopt == 0 {
            return Ok(0);
        }
        let mut adopted = 0;
        if !self.copies.is_empty() {
            let host_pages = rows.row_len(request, Row::Host).map_err(E::Error::from)?.min(to_adopt);
            for page in 0..host_pages {
                let Some(host) = rows.block(request, Row::Host, page).filter(|&h| h != HOST_ONLY) else {
                    continue;
                };
                let Some(hash) = engine.host_hash(host)? else { continue };
                let Some(blocks) = self.copies.get(&hash).cloned() else { continue };
                for (group, &block) in blocks.iter().enumerate().take(rows.groups()) {
                    if engine.adopt(request, page as u32, group, block)? {
                        engine.touch_gpu(&[block])?;
                        rows.set_page(request, Row::Resident(group), page, block).map_err(E::Error::from)?;
                        let s = self.state_mut(slot);
                        s.pinned_clean.insert(page as u32);
                        if page < s.synced {
                            s.stale.insert(page as u32);
                        }
                        adopted += 1;
                    }
                }
            }
        }
        if done {
            self.state_mut(slot).to_adopt = 0;
        }
        Ok(adopted)
    }

    /// The request's clean pinned pages outside its tail, in increasing order: those [`unpin`] can release.
    ///
    /// [`unpin`]: PageBook::unpin
    pub fn releasable(&self, rows: &BlockRows, request: &str) -> Vec<u32> {
        let Some(s) = self.live_state(request) else { return Vec::new() };
        let first_tail = first_tail(rows, request);
        s.pinned_clean.iter().take_while(|&page| (page as usize) < first_tail).collect()
    }

    /// Releases each of `pages` (in this order) that is clean, not being copied, out of the tail and on the
    /// GPU in every group: its blocks go back to the pool in one call, still read until reused. Returns how
    /// many were released.
    pub fn unpin<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
        pages: &[u32],
    ) -> Result<usize, E::Error> {
        let Some(&slot) = self.live.get(request) else { return Ok(0) };
        let first_tail = first_tail(rows, request);
        let mut blocks = Vec::new();
        let mut released = 0;
        for &page in pages {
            let s = self.state(slot);
            if s.copying.contains_key(&page) || !s.valid.contains(page) || page as usize >= first_tail {
                continue;
            }
            let Some(page_blocks) = rows.resident_blocks(request, page as usize) else { continue };
            let name = s.request.clone();
            for &block in &page_blocks {
                let owners = self.owners.entry(block).or_default();
                if !owners.iter().any(|(r, p)| *p == page && *r == name) {
                    owners.push((name.clone(), page));
                }
            }
            blocks.extend_from_slice(&page_blocks);
            let s = self.state_mut(slot);
            s.pinned_clean.remove(page);
            s.released.insert(page);
            released += 1;
        }
        if !blocks.is_empty() {
            engine.unpin(&blocks)?;
        }
        Ok(released)
    }

    /// The pool handed out `block`: a GPU copy indexed on it is forgotten, and every page still read from it
    /// is lost (read from the host from now on, in every group; the request is to be given a hot region).
    pub fn block_reused<E: Engine<Payload = P>>(
        &mut self,
        rows: &mut BlockRows,
        engine: &mut E,
        block: u32,
    ) -> Result<(), E::Error> {
        if let Some(hash) = self.copy_by_block.get(&block).cloned() {
            self.drop_copy(&hash);
        }
        for (request, page) in self.owners.remove(&block).unwrap_or_default() {
            self.lose_page(rows, engine, &request, page)?;
        }
        Ok(())
    }

    fn lose_page<E: Engine<Payload = P>>(
        &mut self,
        rows: &mut BlockRows,
        engine: &mut E,
        request: &str,
        page: u32,
    ) -> Result<(), E::Error> {
        let Some(&slot) = self.live.get(request) else { return Ok(()) };
        for group in 0..rows.groups() {
            let Some(block) =
                rows.block(request, Row::Resident(group), page as usize).filter(|&b| b != HOST_ONLY)
            else {
                continue;
            };
            self.disown(block, request, page);
        }
        engine.drop_resident_page(request, page, None)?;
        rows.drop_page(request, page as usize);
        let s = self.state_mut(slot);
        s.released.remove(page);
        if (page as usize) < s.synced {
            s.stale.insert(page);
        }
        engine.require_hot(request)
    }

    /// Pages the workers have not been told of for each request (stale pages, increasing, then those past
    /// the last update), marking them told. Requests with none are left out; each listed with its index in
    /// `requests`.
    pub fn residency_updates<'a>(
        &mut self,
        rows: &BlockRows,
        requests: impl IntoIterator<Item = &'a str>,
    ) -> Vec<(usize, Vec<u32>)> {
        let mut out = Vec::new();
        for (i, request) in requests.into_iter().enumerate() {
            let slot = self.slot(request);
            let pages = rows.row_len(request, Row::Resident(0)).unwrap_or(0);
            let s = self.state_mut(slot);
            if s.stale.is_empty() && s.synced >= pages {
                continue;
            }
            let mut listed: Vec<u32> = s.stale.iter().collect();
            listed.extend(s.synced as u32..pages as u32);
            s.stale = PageSet::default();
            s.synced = pages;
            out.push((i, listed));
        }
        out
    }

    /// Whether the request's step, ending at `tokens` (past the last `reprefill` tokens, which are not
    /// final), has bookkeeping to do: a sealed page without a host copy planned, a prefix to adopt, a clean
    /// page pinned outside its tail, or no hot region yet (vLLM's `advance_scheduled` would change nothing
    /// otherwise).
    pub fn needs_work<E: Engine<Payload = P>>(
        &self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
        tokens: u64,
        reprefill: u64,
    ) -> Result<bool, E::Error> {
        let Some(s) = self.live_state(request) else { return Ok(true) };
        let importing = self.importing_pages(request);
        let first = (s.ready_prefix as u64).max(importing);
        if first < tokens.saturating_sub(reprefill) / self.block_size || s.to_adopt > 0 {
            return Ok(true);
        }
        if self.pins_past_tail(rows, request, s) {
            return Ok(true);
        }
        Ok(!engine.can_read_from_host(request)?)
    }

    /// Whether the request holds a clean page pinned outside its tail (below it, or past its rows).
    fn pins_past_tail(&self, rows: &BlockRows, request: &str, s: &State<P>) -> bool {
        let pages = rows.row_len(request, Row::Resident(0)).unwrap_or(0);
        let first_tail = pages.saturating_sub(TAIL_PAGES);
        let mut pinned = s.pinned_clean.iter().map(|page| page as usize);
        match pinned.next() {
            None => false,
            Some(page) if page < first_tail => true,
            // Past the first, every page is in the tail or past the rows: a few at most.
            Some(page) => page >= pages || pinned.any(|page| page >= pages),
        }
    }

    /// The step end (tokens) below which the request, reading through its hot region, needs no bookkeeping
    /// as it stands: no sealed page past its durable prefix, nothing to adopt, no import, nothing the workers
    /// lack, no clean page pinned outside its tail. 0 when its next step may need some.
    pub fn quiet_below(&self, rows: &BlockRows, request: &str, reads_host: bool, reprefill: u64) -> u64 {
        let Some(s) = self.live_state(request) else { return 0 };
        if !reads_host || s.to_adopt > 0 || !s.stale.is_empty() || self.imports.contains_key(request) {
            return 0;
        }
        let pages = rows.row_len(request, Row::Resident(0)).unwrap_or(0);
        if s.synced < pages || self.pins_past_tail(rows, request, s) {
            return 0;
        }
        (s.ready_prefix as u64 + 1) * self.block_size + reprefill
    }

    // ------------------------------------------------------------------ the end of a request

    /// The request is freed (finished or preempted): a finished request with copies in flight leases its
    /// prefix's host blocks to its publication, published when they complete; otherwise its publication is
    /// dropped (a preempted step's copies do not prove its KV was computed). Each resident group's row,
    /// tail first: a clean page held is released (its blocks stay readable copies in the pool), a released
    /// page stops being read; either is dropped from the row.
    pub fn free<E: Engine<Payload = P>>(
        &mut self,
        rows: &BlockRows,
        engine: &mut E,
        request: &str,
    ) -> Result<(), E::Error> {
        self.imports.remove(request);
        let Some(slot) = self.live.remove(request) else { return Ok(()) };
        let mut publication = self.state_mut(slot).publication.take();
        if let Some(p) = publication.as_mut() {
            if engine.finished(&p.payload)? && !self.state(slot).copying.is_empty() {
                engine.detach(request, &mut p.payload, p.pages)?;
                p.detached = true;
            } else {
                publication = None;
            }
        }
        let s = self.state_mut(slot);
        s.publication = publication;
        s.live = false;
        for group in 0..rows.groups() {
            let row = rows.row(request, Row::Resident(group)).map_err(E::Error::from)?;
            for (page, &block) in row.iter().enumerate().rev() {
                if block == HOST_ONLY {
                    continue;
                }
                let page = page as u32;
                let s = self.state(slot);
                if s.released.contains(page) {
                    self.disown(block, request, page);
                } else if s.valid.contains(page) && !s.copying.contains_key(&page) {
                    engine.unpin(&[block])?;
                } else {
                    continue;
                }
                engine.drop_resident_page(request, page, Some(group))?;
            }
        }
        self.release_slot_if_done(slot);
        Ok(())
    }

    /// `request`'s `page` no longer reads `block`.
    fn disown(&mut self, block: u32, request: &str, page: u32) {
        if let Some(owners) = self.owners.get_mut(&block) {
            owners.retain(|(r, p)| !(*p == page && &**r == request));
            if owners.is_empty() {
                self.owners.remove(&block);
            }
        }
    }

    /// Forgets every transfer, publication, copy and record (the workers that held them are gone); the
    /// caller gives back the detached publications' leases ([`PageBook::detached`]).
    pub fn forget_all(&mut self) {
        self.states.clear();
        self.free_slots.clear();
        self.live.clear();
        self.transfers.clear();
        self.planned.clear();
        self.owners.clear();
        self.copies.clear();
        self.copy_by_block.clear();
        self.imports.clear();
    }

    /// The detached publications (freed requests waiting on copies in flight), with their requests.
    pub fn detached(&self) -> impl Iterator<Item = (&str, &P)> {
        self.states
            .iter()
            .flatten()
            .filter(|s| !s.live)
            .filter_map(|s| s.publication.as_ref().map(|p| (&*s.request, &p.payload)))
    }

    /// The released (request, page) pairs still reading `block`.
    pub fn owners(&self) -> impl Iterator<Item = (u32, &[(Arc<str>, u32)])> {
        self.owners.iter().map(|(&block, owners)| (block, &**owners))
    }
}

/// The first page of the request's tail: pages from here on stay pinned.
fn first_tail(rows: &BlockRows, request: &str) -> usize {
    rows.row_len(request, Row::Resident(0)).unwrap_or(0).saturating_sub(TAIL_PAGES)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    /// An engine that records every call and answers from its fields.
    #[derive(Default)]
    struct Fake {
        calls: Vec<String>,
        reads_host: HashSet<&'static str>,
        hashes: HashMap<u32, Hash>,
        finished: bool,
    }

    impl Fake {
        fn take(&mut self) -> Vec<String> {
            std::mem::take(&mut self.calls)
        }
    }

    impl Engine for Fake {
        type Payload = &'static str;
        type Error = CoreError;

        fn touch_gpu(&mut self, blocks: &[u32]) -> Result<(), CoreError> {
            self.calls.push(format!("touch_gpu {blocks:?}"));
            Ok(())
        }
        fn touch_host(&mut self, blocks: &[u32]) -> Result<(), CoreError> {
            self.calls.push(format!("touch_host {blocks:?}"));
            Ok(())
        }
        fn release_pins(&mut self, blocks: &[u32]) -> Result<(), CoreError> {
            self.calls.push(format!("release_pins {blocks:?}"));
            Ok(())
        }
        fn free_host(&mut self, blocks: &[u32]) -> Result<(), CoreError> {
            self.calls.push(format!("free_host {blocks:?}"));
            Ok(())
        }
        fn unpin(&mut self, blocks: &[u32]) -> Result<(), CoreError> {
            self.calls.push(format!("unpin {blocks:?}"));
            Ok(())
        }
        fn host_hash(&mut self, block: u32) -> Result<Option<Hash>, CoreError> {
            Ok(self.hashes.get(&block).cloned())
        }
        fn can_read_from_host(&mut self, request: &str) -> Result<bool, CoreError> {
            Ok(self.reads_host.contains(request))
        }
        fn drop_resident_page(
            &mut self,
            request: &str,
            page: u32,
            group: Option<usize>,
        ) -> Result<(), CoreError> {
            self.calls.push(format!("drop {request} {page} {group:?}"));
            Ok(())
        }
        fn adopt(&mut self, request: &str, page: u32, group: usize, block: u32) -> Result<bool, CoreError> {
            self.calls.push(format!("adopt {request} {page} {group} {block}"));
            Ok(true)
        }
        fn require_hot(&mut self, request: &str) -> Result<(), CoreError> {
            self.calls.push(format!("require_hot {request}"));
            Ok(())
        }
        fn publish(&mut self, payload: &&'static str, tokens: u64) -> Result<(), CoreError> {
            self.calls.push(format!("publish {payload} {tokens}"));
            Ok(())
        }
        fn finished(&mut self, _: &&'static str) -> Result<bool, CoreError> {
            Ok(self.finished)
        }
        fn detach(&mut self, request: &str, _: &mut &'static str, pages: usize) -> Result<(), CoreError> {
            self.calls.push(format!("detach {request} {pages}"));
            Ok(())
        }
        fn publish_detached(&mut self, payload: &&'static str, full_pages: usize) -> Result<(), CoreError> {
            self.calls.push(format!("publish_detached {payload} {full_pages}"));
            Ok(())
        }
        fn release_order(&mut self, _: &str, mut pages: Vec<u32>) -> Result<Vec<u32>, CoreError> {
            pages.reverse();
            Ok(pages)
        }
        fn publish_order(&mut self, mut requests: Vec<Arc<str>>) -> Result<Vec<Arc<str>>, CoreError> {
            requests.reverse();
            Ok(requests)
        }
        fn without_region(&mut self, request: &str, _: usize) -> Result<(), CoreError> {
            self.calls.push(format!("without_region {request}"));
            Ok(())
        }
    }

    const BS: u32 = 4;

    /// Rows of `pages` pages in two resident groups (blocks `10 p` and `10 p + 1`) and the host's (`100 + p`).
    fn rows(request: &str, pages: u32) -> BlockRows {
        let mut rows = BlockRows::new(2, BS).unwrap();
        rows.set(request, Row::Resident(0), (0..pages).map(|p| 10 * p).collect()).unwrap();
        rows.set(request, Row::Resident(1), (0..pages).map(|p| 10 * p + 1).collect()).unwrap();
        rows.set(request, Row::Host, (0..pages).map(|p| 100 + p).collect()).unwrap();
        rows
    }

    fn book() -> PageBook<&'static str> {
        PageBook::new(BS, 64).unwrap()
    }

    #[test]
    fn a_page_is_copied_made_clean_released_and_lost() {
        let (mut rows, mut book, mut e) = (rows("r", 6), book(), Fake::default());
        e.reads_host.insert("r");
        book.materialize(&rows, &mut e, "r", 6 * u64::from(BS)).unwrap();
        assert_eq!(book.in_flight(), 6);
        assert_eq!(e.take()[..2], ["touch_host [100]", "touch_gpu [0, 1]"]);
        let planned = book.take_planned();
        assert_eq!((planned[1].id, planned[1].host, &*planned[1].resident), (1, 101, &[10, 11][..]));
        // Enqueued by both workers: pins given back; completed: clean, released outside the tail, published.
        book.set_publication("r", Some(("pub", 6 * u64::from(BS))));
        let reports: Vec<(u64, u64)> = (0..6).map(|id| (id, 2)).collect();
        book.update_transfers(&mut rows, &mut e, &reports, &[]).unwrap();
        assert_eq!(book.pages("r").unwrap().copying.len(), 6, "enqueued is not complete");
        book.update_transfers(&mut rows, &mut e, &[], &reports).unwrap();
        let pages = book.pages("r").unwrap();
        assert_eq!((pages.ready_prefix, pages.valid.len(), pages.publication), (6, 6, None));
        assert_eq!(pages.released, [0, 1, 2, 3], "the tail stays pinned");
        assert_eq!(pages.pinned_clean, [4, 5]);
        let calls = e.take();
        assert!(
            calls.contains(&"unpin [20, 21]".to_string()) && calls.contains(&"publish pub 24".to_string())
        );
        assert_eq!(book.in_flight(), 0);
        // Its block reused: page 2 is lost in every group, the request needs its hot region.
        book.residency_updates(&rows, ["r"]);
        book.block_reused(&mut rows, &mut e, 21).unwrap();
        assert_eq!(e.take(), ["drop r 2 None", "require_hot r"]);
        let pages = book.pages("r").unwrap();
        assert_eq!((pages.released, pages.stale), (vec![0, 1, 3], vec![2]));
        assert_eq!(rows.block("r", Row::Resident(0), 2), Some(HOST_ONLY));
        // The other group's block of the page no longer names it: its reuse loses nothing more.
        book.block_reused(&mut rows, &mut e, 20).unwrap();
        assert!(e.take().is_empty());
        assert_eq!(book.residency_updates(&rows, ["r"]), [(0, vec![2])]);
    }

    #[test]
    fn a_step_plans_copies_then_releases_in_the_policys_order_or_leaves_the_region_to_it() {
        let (mut rows, mut book, mut e) = (rows("r", 6), book(), Fake::default());
        let steps = [("r".to_string(), 6 * u64::from(BS))];
        // Not reading through a hot region: its copies are planned, the policy asked.
        assert_eq!(book.advance(&mut rows, &mut e, &steps, u64::from(BS)).unwrap(), 0);
        assert_eq!(book.in_flight(), 5, "the page of the last reprefill tokens is not final");
        assert_eq!(e.take().last().unwrap(), "without_region r");
        let reports: Vec<(u64, u64)> = (0..5).map(|id| (id, 1)).collect();
        book.update_transfers(&mut rows, &mut e, &reports, &reports).unwrap();
        e.reads_host.insert("r");
        e.take();
        // Reading through it: its clean pages out of the tail (0-3 of 6) go, tail first.
        assert_eq!(book.advance(&mut rows, &mut e, &steps, u64::from(BS)).unwrap(), 4);
        assert_eq!(e.take(), ["unpin [30, 31, 20, 21, 10, 11, 0, 1]"]);
    }

    #[test]
    fn a_page_is_planned_once_and_only_with_its_blocks() {
        let (mut rows, mut book, mut e) = (rows("r", 3), book(), Fake::default());
        assert!(book.plan(&rows, &mut e, "r", 1, true, false).unwrap());
        assert!(!book.plan(&rows, &mut e, "r", 1, true, false).unwrap(), "being copied");
        assert!(!book.plan(&rows, &mut e, "r", 3, true, false).unwrap(), "past the rows");
        rows.set_page("r", Row::Resident(1), 2, HOST_ONLY).unwrap();
        assert!(!book.plan(&rows, &mut e, "r", 2, true, false).unwrap(), "read from the host in a group");
        rows.set_page("r", Row::Host, 0, HOST_ONLY).unwrap();
        assert!(!book.plan(&rows, &mut e, "r", 0, true, false).unwrap(), "no host block");
        assert_eq!(book.in_flight(), 1);
    }

    #[test]
    fn materializing_starts_past_the_durable_prefix_and_an_import_within_the_budget() {
        let (rows, mut e) = (rows("r", 8), Fake::default());
        let mut book = PageBook::new(BS, 3).unwrap();
        book.commit_computed("r", 2);
        book.record_import("r", 2 * u64::from(BS) + 1);
        book.materialize(&rows, &mut e, "r", 8 * u64::from(BS)).unwrap();
        let pages: Vec<u32> = book.transfers().iter().map(|t| t.page).collect();
        assert_eq!(pages, [3, 4, 5], "from the import's last page on, three at most");
    }

    #[test]
    fn a_finished_request_publishes_its_prefix_once_its_copies_complete() {
        let (mut rows, mut book, mut e) = (rows("r", 4), book(), Fake::default());
        book.materialize(&rows, &mut e, "r", 2 * u64::from(BS)).unwrap();
        book.set_publication("r", Some(("pub", 2 * u64::from(BS))));
        e.finished = true;
        book.free(&rows, &mut e, "r").unwrap();
        assert!(e.take().contains(&"detach r 2".to_string()));
        assert!(!book.knows("r") && book.in_flight() == 2 && book.detached().count() == 1);
        book.update_transfers(&mut rows, &mut e, &[(0, 1), (1, 1)], &[(0, 1)]).unwrap();
        assert!(!e.calls.iter().any(|c| c.starts_with("publish_detached")), "a copy is still in flight");
        book.update_transfers(&mut rows, &mut e, &[], &[(1, 1)]).unwrap();
        assert!(e.take().contains(&"publish_detached pub 2".to_string()));
        assert_eq!(
            (book.detached().count(), book.states.iter().flatten().count()),
            (0, 0),
            "the record is gone"
        );
    }

    #[test]
    fn a_preempted_request_drops_its_publication_and_releases_its_clean_pages() {
        let (mut rows, mut book, mut e) = (rows("r", 4), book(), Fake::default());
        book.commit_computed("r", 2);
        book.set_publication("r", Some(("pub", 2 * u64::from(BS))));
        book.free(&rows, &mut e, "r").unwrap();
        // Tail first, group by group: the clean pages 1 and 0 are released and dropped; the others kept.
        assert_eq!(
            e.take(),
            [
                "unpin [10]",
                "drop r 1 Some(0)",
                "unpin [0]",
                "drop r 0 Some(0)",
                "unpin [11]",
                "drop r 1 Some(1)",
                "unpin [1]",
                "drop r 0 Some(1)"
            ]
        );
        assert_eq!(book.detached().count(), 0);
        rows.clear("r", Row::Host).unwrap();
    }

    #[test]
    fn a_prefix_hit_adopts_the_gpu_copies_indexed_for_its_host_blocks() {
        let (mut rows, mut book, mut e) = (rows("a", 3), book(), Fake::default());
        e.hashes.insert(100, Arc::from(&b"h0"[..]));
        e.reads_host.insert("a");
        book.set_publication("a", Some(("pa", 3 * u64::from(BS))));
        book.materialize(&rows, &mut e, "a", 3 * u64::from(BS)).unwrap();
        book.update_transfers(&mut rows, &mut e, &[(0, 1), (1, 1), (2, 1)], &[(0, 1), (1, 1), (2, 1)])
            .unwrap();
        assert_eq!(book.copy_of(b"h0"), Some(&[0, 1][..]), "the published page's GPU copy is indexed");
        // "b" holds the host block of page 0 with no GPU block: it adopts the copy.
        rows.set("b", Row::Resident(0), vec![HOST_ONLY, 50]).unwrap();
        rows.set("b", Row::Resident(1), vec![HOST_ONLY, 51]).unwrap();
        rows.set("b", Row::Host, vec![100, 150]).unwrap();
        book.commit_computed("b", 1);
        e.take();
        assert_eq!(book.adopt(&mut rows, &mut e, "b", true).unwrap(), 2);
        assert_eq!(e.take(), ["adopt b 0 0 0", "touch_gpu [0]", "adopt b 0 1 1", "touch_gpu [1]"]);
        assert_eq!(rows.resident_blocks("b", 0), Some(vec![0, 1]));
        assert_eq!(book.pages("b").unwrap().pinned_clean, [0]);
        // Page 0 of "a" was released (out of its tail): its block's reuse forgets the copy, and "a" loses it.
        book.block_reused(&mut rows, &mut e, 0).unwrap();
        assert_eq!(book.copy_of(b"h0"), None);
        assert_eq!(e.take(), ["drop a 0 None", "require_hot a"]);
    }

    #[test]
    fn residency_updates_list_stale_pages_then_new_ones_once() {
        let (mut rows, mut book) = (rows("r", 3), book());
        assert_eq!(book.residency_updates(&rows, ["x", "r"]), [(1, vec![0, 1, 2])]);
        assert!(book.residency_updates(&rows, ["r"]).is_empty());
        rows.extend("r", Row::Resident(0), &[30]).unwrap();
        assert_eq!(book.residency_updates(&rows, ["r"]), [(0, vec![3])]);
        assert!(book.knows("x"), "reading a request's updates makes its record, as vLLM's does");
    }
}
