//! The block rows of an engine that owns its block ids (vLLM 0.33's HiSparse): per request, the GPU block of
//! each page in every resident group (with its residency changes applied: a page read from the host holds
//! [`HOST_ONLY`]) and the host block of each page. The engine stays the one allocator; it reports each change
//! of a row here as it makes it, and the scans its scheduler runs every step over every scheduled request
//! (the rows the worker mirrors to the host, whether a step reads anything from the host) run here over
//! plain integers, in one call for the whole batch.
//!
//! A row that was never reported is empty: vLLM's scans treat a request with no row the way they treat an
//! empty one (no page of it is mirrored or resident), so the two need not be told apart.
//!
//! Most steps change nothing in the engine's own per-request bookkeeping (a decode within its last page),
//! which it can only tell by reading that state. It marks such a request quiet below some token count
//! ([`BlockRows::quiet`]); a change of any of its rows wakes it, and [`BlockRows::scan`] sorts a batch, so
//! the engine reads its state for the few requests that are not quiet.

use crate::error::{invalid, Result};
use crate::slab::{Handle, NamedSlab};

/// A page with no GPU block in its group: it is read from the host (vLLM's null block).
pub const HOST_ONLY: u32 = u32::MAX;

/// The most resident groups a request's rows may have (vLLM's DeepSeek-V3.2 layout has 6): a bound that
/// refuses a count no layout has, rather than allocating for it per request.
pub const MAX_GROUPS: usize = 64;

/// The largest block size: a row's slot (`block id x block size + offset`, block ids below 2^32) then fits the
/// i64 slots vLLM's worker reads.
pub const MAX_BLOCK_SIZE: u32 = 1 << 31;

/// Which of a request's rows: a resident group's, or the host group's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Row {
    Resident(usize),
    Host,
}

/// The most rows (resident groups and the host's) whose last common page [`Rows`] keeps beside its other
/// fields ([`Rows::tail`]): DeepSeek-V3.2's layout has seven.
const TAIL_ROWS: usize = 8;

/// A request's rows, page by page: row `k`'s block of page `p` (the resident groups' rows, then the host's)
/// at `ids[p * stride + k]`, so a page's blocks share the cache line a mirror of it reads (a scan over the
/// batch finds every request's rows cold). Each row has its own length; the slots past it are unused.
#[derive(Clone, Debug)]
struct Rows {
    ids: Vec<u32>,
    lens: Vec<usize>,
    /// [`HOST_ONLY`] pages within the resident rows, so "is every page resident" is O(1).
    host_only: usize,
    /// A step ending below this many tokens needs none of the engine's bookkeeping (0: any step may).
    quiet_below: u64,
    /// The shortest row's length: the pages every row holds, the only ones a mirror reads.
    shortest: usize,
    /// Page `shortest - 1` of every row (with at most [`TAIL_ROWS`] rows): the page a decode step writes,
    /// which a batch scan reads for every request. Read here, beside the fields the scan reads anyway, it
    /// costs no line of `ids`, far into a long request's rows and cold (the scan's cost grew with context).
    tail: [u32; TAIL_ROWS],
}

impl Rows {
    fn new(stride: usize) -> Self {
        let tail = [HOST_ONLY; TAIL_ROWS];
        Self { ids: Vec::new(), lens: vec![0; stride], host_only: 0, quiet_below: 0, shortest: 0, tail }
    }

    fn stride(&self) -> usize {
        self.lens.len()
    }

    /// Whether row `k` counts toward [`Rows::host_only`] (a resident group's: every row but the last).
    fn resident(&self, k: usize) -> bool {
        k + 1 < self.stride()
    }

    fn get(&self, k: usize, page: usize) -> Option<u32> {
        (page < self.lens[k]).then(|| self.ids[page * self.stride() + k])
    }

    /// Whether [`Rows::page`] reads `page` from [`Rows::tail`] rather than from `ids`.
    fn inline(&self, page: usize) -> bool {
        page.saturating_add(1) == self.shortest && self.stride() <= TAIL_ROWS
    }

    /// Every row's block of `page`, which every row holds (below [`Rows::shortest`]).
    fn page(&self, page: usize) -> &[u32] {
        let stride = self.stride();
        if self.inline(page) {
            &self.tail[..stride]
        } else {
            &self.ids[page * stride..(page + 1) * stride]
        }
    }

    fn row(&self, k: usize) -> Vec<u32> {
        (0..self.lens[k]).map(|page| self.ids[page * self.stride() + k]).collect()
    }

    /// Brings [`Rows::shortest`] and [`Rows::tail`] up to date, after any change of `ids` or `lens`.
    fn changed(&mut self) {
        let stride = self.stride();
        self.shortest = self.lens.iter().min().copied().unwrap_or(0);
        if stride <= TAIL_ROWS && self.shortest > 0 {
            let page = self.shortest - 1;
            self.tail[..stride].copy_from_slice(&self.ids[page * stride..(page + 1) * stride]);
        }
    }

    fn truncate(&mut self, k: usize) {
        if self.resident(k) {
            self.host_only -= self.row(k).iter().filter(|&&id| id == HOST_ONLY).count();
        }
        self.lens[k] = 0;
        self.changed();
    }

    fn extend(&mut self, k: usize, ids: &[u32]) {
        let (stride, start) = (self.stride(), self.lens[k]);
        let end = start + ids.len();
        if self.ids.len() < end * stride {
            self.ids.resize(end * stride, HOST_ONLY);
        }
        for (page, &id) in (start..end).zip(ids) {
            self.ids[page * stride + k] = id;
        }
        if self.resident(k) {
            self.host_only += ids.iter().filter(|&&id| id == HOST_ONLY).count();
        }
        self.lens[k] = end;
        self.changed();
    }

    fn set_page(&mut self, k: usize, page: usize, id: u32) -> Result<()> {
        let Some(old) = self.get(k, page) else {
            return invalid(format!("page {page} is past the row's {} pages", self.lens[k]));
        };
        if self.resident(k) {
            self.host_only = self.host_only + usize::from(id == HOST_ONLY) - usize::from(old == HOST_ONLY);
        }
        let stride = self.stride();
        self.ids[page * stride + k] = id;
        self.changed();
        Ok(())
    }
}

/// A contiguous span of one page's rows to copy from the resident groups to the host (vLLM's
/// `SparseKVRowMirror`): token-row offsets, each `block * block_size + offset`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mirror {
    /// One start per resident group, in group order.
    pub sources: Vec<u64>,
    pub destination: u64,
    pub rows: u32,
}

/// Whether a step ending at `tokens` of a request with these rows (none: never reported) may need the
/// engine's bookkeeping: it is not marked quiet past that ([`BlockRows::quiet`]).
fn busy(rows: Option<&Rows>, tokens: u64) -> bool {
    rows.map_or(true, |rows| tokens >= rows.quiet_below)
}

/// One scheduled request's step, as [`BlockRows::scan`] reads it: `mirror_rows` token rows to mirror from
/// `mirror_from`, and the tokens computed once the step has run (`end`). `handle`, when the caller kept one
/// for `request` (a previous scan's [`Scan::handles`]), finds its rows without the name while it is current.
#[derive(Clone, Copy, Debug)]
pub struct Step<'a> {
    pub request: &'a str,
    pub handle: Option<Handle>,
    pub mirror_from: u64,
    pub mirror_rows: u64,
    pub end: u64,
}

/// A batch's per-step views ([`BlockRows::scan`]), flat: no allocation per request or mirror.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scan {
    /// How many mirrors each step has, in step order; the mirrors follow in the same order.
    pub counts: Vec<u32>,
    /// Each mirror's source starts, one per resident group ([`Mirror::sources`] back to back).
    pub sources: Vec<u64>,
    pub destinations: Vec<u64>,
    pub rows: Vec<u32>,
    /// Whether every step reads only resident pages ([`BlockRows::all_resident`]).
    pub all_resident: bool,
    /// The steps, by index, that may need the engine's bookkeeping ([`BlockRows::busy`]).
    pub busy: Vec<usize>,
    /// Each step's request's handle (none: it has no rows), for the caller's next scan ([`Step::handle`]).
    pub handles: Vec<Option<Handle>>,
}

impl Scan {
    /// Room for `steps` steps of one mirror each (a decode's, the usual step), so that a batch's scan
    /// allocates each vector once: growing them a push at a time reallocated each several times a step.
    fn with_capacity(steps: usize, groups: usize) -> Self {
        Self {
            counts: Vec::with_capacity(steps),
            sources: Vec::with_capacity(steps * groups),
            destinations: Vec::with_capacity(steps),
            rows: Vec::with_capacity(steps),
            all_resident: true,
            busy: Vec::with_capacity(steps),
            handles: Vec::with_capacity(steps),
        }
    }

    /// The mirrors of step `i` (their source starts `groups` a mirror), as [`Mirror`]s.
    pub fn mirrors(&self, i: usize, groups: usize) -> Vec<Mirror> {
        let first: usize = self.counts[..i].iter().map(|&n| n as usize).sum();
        (first..first + self.counts[i] as usize)
            .map(|m| Mirror {
                sources: self.sources[m * groups..(m + 1) * groups].to_vec(),
                destination: self.destinations[m],
                rows: self.rows[m],
            })
            .collect()
    }
}

/// Every request's rows (module docs).
#[derive(Clone, Debug)]
pub struct BlockRows {
    groups: usize,
    block_size: u32,
    /// By request id, or through the handle a scan returned for it ([`Scan::handles`]).
    requests: NamedSlab<Rows>,
    /// Row changes so far: the engine tells whether any row changed between two of its calls.
    changes: u64,
}

impl BlockRows {
    /// Rows for `groups` resident groups of `block_size`-token pages (the host group's pages are as large).
    pub fn new(groups: usize, block_size: u32) -> Result<Self> {
        if groups == 0 || groups > MAX_GROUPS || block_size == 0 || block_size > MAX_BLOCK_SIZE {
            return invalid(format!(
                "need 1 to {MAX_GROUPS} resident groups and a block size of 1 to {MAX_BLOCK_SIZE} tokens, not \
                 {groups} groups of {block_size}"
            ));
        }
        Ok(Self { groups, block_size, requests: NamedSlab::default(), changes: 0 })
    }

    pub fn groups(&self) -> usize {
        self.groups
    }

    pub fn block_size(&self) -> u32 {
        self.block_size
    }

    /// How many times a row has changed (a count that only grows).
    pub fn changes(&self) -> u64 {
        self.changes
    }

    /// Requests with any row.
    pub fn len(&self) -> usize {
        self.requests.len()
    }

    pub fn is_empty(&self) -> bool {
        self.requests.is_empty()
    }

    /// The rows of `request` to change (made when it has none), and which of them `row` is.
    fn rows_mut(&mut self, request: &str, row: Row) -> Result<(&mut Rows, usize)> {
        let k = self.index(row)?;
        let stride = self.groups + 1;
        Ok((self.requests.get_or_insert_with(request, || Rows::new(stride)), k))
    }

    fn index(&self, row: Row) -> Result<usize> {
        match row {
            Row::Resident(group) if group >= self.groups => {
                invalid(format!("resident group {group} out of range: there are {}", self.groups))
            }
            Row::Resident(group) => Ok(group),
            Row::Host => Ok(self.groups),
        }
    }

    /// Replaces a row whole (after a change that may touch any of its pages: an admission, an import).
    pub fn set(&mut self, request: &str, row: Row, ids: Vec<u32>) -> Result<()> {
        let (rows, k) = self.rows_mut(request, row)?;
        rows.truncate(k);
        rows.extend(k, &ids);
        rows.quiet_below = 0;
        self.changes += 1;
        Ok(())
    }

    /// Appends pages to a row (the blocks an allocation added).
    pub fn extend(&mut self, request: &str, row: Row, ids: &[u32]) -> Result<()> {
        let (rows, k) = self.rows_mut(request, row)?;
        rows.extend(k, ids);
        rows.quiet_below = 0;
        self.changes += 1;
        Ok(())
    }

    /// Where a row the engine grew by `added` pages, to `now` pages, is caught up from by appending: its first
    /// page not recorded yet; `None` when appending cannot catch it up (the row also changed in a way not
    /// reported here: the engine sets it whole).
    pub fn growth_start(&self, request: &str, row: Row, added: usize, now: usize) -> Result<Option<usize>> {
        let recorded = self.row_len(request, row)?;
        Ok((recorded <= now && recorded.saturating_add(added) >= now).then_some(recorded))
    }

    /// One page of a row changed (a page adopted or dropped). The page must exist.
    pub fn set_page(&mut self, request: &str, row: Row, page: usize, id: u32) -> Result<()> {
        let k = self.index(row)?;
        let Some(rows) = self.requests.get_mut(request) else {
            return invalid(format!("request {request:?} has no rows"));
        };
        rows.set_page(k, page, id)?;
        rows.quiet_below = 0;
        self.changes += 1;
        Ok(())
    }

    /// The engine stopped reading `request`'s `page` from the GPU (its blocks were reused): [`HOST_ONLY`] in
    /// every resident row that has the page. A request without rows has none to drop.
    pub fn drop_page(&mut self, request: &str, page: usize) {
        let Some(rows) = self.requests.get_mut(request) else { return };
        for k in 0..self.groups {
            if page < rows.lens[k] {
                rows.set_page(k, page, HOST_ONLY).expect("a page within the row");
            }
        }
        rows.quiet_below = 0;
        self.changes += 1;
    }

    /// A row was given back (its request freed or preempted); a request with no row left is forgotten.
    pub fn clear(&mut self, request: &str, row: Row) -> Result<()> {
        self.set(request, row, Vec::new())?;
        if self.requests.get(request).is_some_and(|rows| rows.lens.iter().all(|&len| len == 0)) {
            self.requests.remove(request);
        }
        Ok(())
    }

    /// The engine found that `request`'s steps ending below `tokens` need none of its bookkeeping, as long as
    /// its rows do not change (a change of any of them wakes it); a request with no rows is never quiet.
    pub fn quiet(&mut self, request: &str, tokens: u64) {
        if let Some(rows) = self.requests.get_mut(request) {
            rows.quiet_below = tokens;
        }
    }

    /// Something outside the rows changed what `request`'s next step needs: it is no longer quiet.
    pub fn wake(&mut self, request: &str) {
        self.quiet(request, 0);
    }

    /// Whether a step of `request` ending at `tokens` may need the engine's bookkeeping (not [`quiet`]).
    ///
    /// [`quiet`]: BlockRows::quiet
    pub fn busy(&self, request: &str, tokens: u64) -> bool {
        busy(self.requests.get(request), tokens)
    }

    /// Forgets every row (the engine's pools were reset).
    pub fn clear_all(&mut self) {
        self.requests.clear();
        self.changes += 1;
    }

    /// A row as recorded; empty when never reported.
    pub fn row(&self, request: &str, row: Row) -> Result<Vec<u32>> {
        let k = self.index(row)?;
        Ok(self.requests.get(request).map_or_else(Vec::new, |rows| rows.row(k)))
    }

    /// How many pages a row holds.
    pub fn row_len(&self, request: &str, row: Row) -> Result<usize> {
        let k = self.index(row)?;
        Ok(self.requests.get(request).map_or(0, |rows| rows.lens[k]))
    }

    /// A row's block of `page` ([`HOST_ONLY`] for a page read from the host); `None` past the row.
    pub fn block(&self, request: &str, row: Row, page: usize) -> Option<u32> {
        let k = self.index(row).ok()?;
        self.requests.get(request)?.get(k, page)
    }

    /// The page's block in every resident group, or `None` when a group reads it from the host or does not
    /// have it.
    pub fn resident_blocks(&self, request: &str, page: usize) -> Option<Vec<u32>> {
        let rows = self.requests.get(request)?;
        (0..self.groups).map(|g| rows.get(g, page).filter(|&id| id != HOST_ONLY)).collect()
    }

    /// Every resident group's block of each page, page by page (`pages.len() x groups` ids, [`HOST_ONLY`]
    /// for a page a group reads from the host or does not have).
    pub fn blocks_at(&self, request: &str, pages: &[usize]) -> Vec<u32> {
        let Some(rows) = self.requests.get(request) else {
            return vec![HOST_ONLY; pages.len() * self.groups];
        };
        pages
            .iter()
            .flat_map(|&page| (0..self.groups).map(move |g| rows.get(g, page).unwrap_or(HOST_ONLY)))
            .collect()
    }

    /// The spans of token rows `start .. start + count` of `request` to mirror to the host: each page's
    /// rows, when every resident group holds the page on the GPU and the host has a block for it (vLLM's
    /// `build_row_mirrors`: a page without either is skipped, its neighbours still mirrored).
    pub fn mirrors(&self, request: &str, start: u64, count: u64) -> Vec<Mirror> {
        let mut scan = Scan::with_capacity(1, self.groups);
        if let Some(rows) = self.requests.get(request) {
            let made = self.push_mirrors(rows, start, count, &mut scan);
            scan.counts.push(made);
            return scan.mirrors(0, self.groups);
        }
        Vec::new()
    }

    /// Appends to `scan` the mirrors of rows `start .. start + count` ([`BlockRows::mirrors`]); returns how many.
    fn push_mirrors(&self, rows: &Rows, start: u64, count: u64, scan: &mut Scan) -> u32 {
        let (block_size, groups) = (u64::from(self.block_size), self.groups);
        // A page past the shortest row is never mirrored: the walk stops there, whatever `count` says.
        let end = start.saturating_add(count).min((rows.shortest as u64).saturating_mul(block_size));
        let mut made = 0;
        let mut position = start;
        while position < end {
            let (page, offset) = (position / block_size, position % block_size);
            let num_rows = (block_size - offset).min(end - position);
            position += num_rows;
            let Ok(page) = usize::try_from(page) else { break };
            let ids = rows.page(page);
            if ids.contains(&HOST_ONLY) {
                continue; // a group reads the page from the host, or the host has no block for it
            }
            scan.sources.extend(ids[..groups].iter().map(|&id| u64::from(id) * block_size + offset));
            scan.destinations.push(u64::from(ids[groups]) * block_size + offset);
            scan.rows.push(u32::try_from(num_rows).expect("a span is at most one page of rows"));
            made += 1;
        }
        made
    }

    /// Whether `request` reads nothing from the host for a step ending at `tokens`: its first resident row
    /// reaches the step's last page and no resident row has a page read from the host (vLLM's
    /// `all_context_pages_resident`, for one request).
    pub fn all_resident(&self, request: &str, tokens: u64) -> bool {
        self.resident_through(self.requests.get(request), tokens)
    }

    fn resident_through(&self, rows: Option<&Rows>, tokens: u64) -> bool {
        let pages = tokens.div_ceil(u64::from(self.block_size));
        rows.map_or(pages == 0, |rows| rows.host_only == 0 && rows.lens[0] as u64 >= pages)
    }

    /// vLLM's per-step views of a batch, in one pass: each step's mirrors ([`BlockRows::mirrors`]), whether
    /// every step reads only resident pages ([`BlockRows::all_resident`] at its end), and the steps that may
    /// need the engine's bookkeeping ([`BlockRows::busy`] at its end).
    ///
    /// A batch's rows are cold when the engine asks (it has run its own code since the last step). A decode
    /// step reads only its request's slot: the fields it tests and the page it writes ([`Rows::tail`]); a
    /// step that mirrors an earlier page reads that page in `ids` too, through the slot. So every request is
    /// found first (through the handle the caller kept, [`Step::handle`], else by name: the map's bucket and
    /// the name's allocation, two more cold lines) and what it reads loaded in a second pass, whose loads do
    /// not depend on each other: the cache misses of many requests overlap, where one loop would wait out
    /// each request's in turn.
    pub fn scan(&self, steps: &[Step]) -> Scan {
        let mut scan = Scan::with_capacity(steps.len(), self.groups);
        let found: Vec<Option<&Rows>> = steps
            .iter()
            .map(|step| {
                let kept = step.handle.and_then(|handle| Some((handle, self.requests.by_handle(handle)?)));
                let found = kept.or_else(|| self.requests.find(step.request));
                scan.handles.push(found.map(|(handle, _)| handle));
                found.map(|(_, rows)| rows)
            })
            .collect();
        let block_size = u64::from(self.block_size);
        let mut touched = 0u64;
        for (step, rows) in steps.iter().zip(&found) {
            if let Some(rows) = rows {
                let page = usize::try_from(step.mirror_from / block_size).unwrap_or(usize::MAX);
                touched ^= rows.quiet_below ^ u64::from(rows.tail[0]);
                if !rows.inline(page) {
                    touched ^=
                        u64::from(rows.ids.get(page.saturating_mul(rows.stride())).copied().unwrap_or(0));
                }
            }
        }
        std::hint::black_box(touched);
        for (i, (step, rows)) in steps.iter().zip(found).enumerate() {
            let made =
                rows.map_or(0, |rows| self.push_mirrors(rows, step.mirror_from, step.mirror_rows, &mut scan));
            scan.counts.push(made);
            scan.all_resident = scan.all_resident && self.resident_through(rows, step.end);
            if busy(rows, step.end) {
                scan.busy.push(i);
            }
        }
        scan
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// vLLM's `build_row_mirrors` over rows as plain vectors (`rows[k]`: row `k`'s ids, the host's last): the
    /// specification [`BlockRows::mirrors`] must meet, whatever it keeps inline.
    fn mirrors_of(rows: &[Vec<u32>], block_size: u64, start: u64, count: u64) -> Vec<Mirror> {
        let groups = rows.len() - 1;
        let shortest = rows.iter().map(Vec::len).min().unwrap_or(0) as u64;
        let mut out = Vec::new();
        let mut position = start;
        while position < start.saturating_add(count).min(shortest * block_size) {
            let (page, offset) = ((position / block_size) as usize, position % block_size);
            let num_rows =
                (block_size - offset).min(start + count - position).min(shortest * block_size - position);
            position += num_rows;
            if rows.iter().any(|row| row[page] == HOST_ONLY) {
                continue;
            }
            out.push(Mirror {
                sources: (0..groups).map(|g| u64::from(rows[g][page]) * block_size + offset).collect(),
                destination: u64::from(rows[groups][page]) * block_size + offset,
                rows: num_rows as u32,
            });
        }
        out
    }

    /// A change of a request's rows: `(op, row, page or length, id)`, read modulo what exists.
    fn change() -> impl Strategy<Value = (u8, usize, usize, u32)> {
        (0..5u8, 0..16usize, 0..12usize, prop_oneof![0..6u32, Just(HOST_ONLY)])
    }

    proptest! {
        /// Through any changes, and with few rows (the last common page kept inline) or many, every scan
        /// mirrors what the rows hold, at every window.
        #[test]
        fn scans_mirror_what_the_rows_hold(groups in prop::sample::select(vec![1usize, 6, 7, 9]),
                                          changes in prop::collection::vec(change(), 1..40)) {
            let mut rows = BlockRows::new(groups, 4).unwrap();
            let mut plain = vec![Vec::new(); groups + 1];
            for (op, k, n, id) in changes {
                let k = k % (groups + 1);
                let row = if k == groups { Row::Host } else { Row::Resident(k) };
                match op {
                    0 => {
                        rows.extend("a", row, &vec![id; n % 3 + 1]).unwrap();
                        plain[k].extend(vec![id; n % 3 + 1]);
                    }
                    1 => {
                        rows.set("a", row, vec![id; n]).unwrap();
                        plain[k] = vec![id; n];
                    }
                    2 if !plain[k].is_empty() => {
                        let page = n % plain[k].len();
                        rows.set_page("a", row, page, id).unwrap();
                        plain[k][page] = id;
                    }
                    3 => {
                        rows.drop_page("a", n);
                        for row in &mut plain[..groups] {
                            if let Some(slot) = row.get_mut(n) {
                                *slot = HOST_ONLY;
                            }
                        }
                    }
                    _ => {}
                }
                for start in 0..20 {
                    for count in [1, 3, 4, 9] {
                        prop_assert_eq!(rows.mirrors("a", start, count), mirrors_of(&plain, 4, start, count));
                    }
                }
            }
        }
    }

    fn rows() -> BlockRows {
        let mut rows = BlockRows::new(2, 4).unwrap();
        rows.set("a", Row::Resident(0), vec![10, 11, 12]).unwrap();
        rows.set("a", Row::Resident(1), vec![20, 21, 22]).unwrap();
        rows.set("a", Row::Host, vec![30, 31, 32]).unwrap();
        rows
    }

    #[test]
    fn a_window_mirrors_each_page_it_touches() {
        let rows = rows();
        // rows 3 .. 9: the last row of page 0, all of page 1, the first row of page 2.
        assert_eq!(
            rows.mirrors("a", 3, 6),
            vec![
                Mirror { sources: vec![43, 83], destination: 123, rows: 1 },
                Mirror { sources: vec![44, 84], destination: 124, rows: 4 },
                Mirror { sources: vec![48, 88], destination: 128, rows: 1 },
            ]
        );
        assert!(rows.mirrors("unknown", 0, 8).is_empty());
        // A window reaching past the rows, however far, mirrors the same pages, and returns at once.
        assert_eq!(rows.mirrors("a", 3, u64::MAX), rows.mirrors("a", 3, 9));
        assert!(rows.mirrors("a", u64::MAX - 1, u64::MAX).is_empty());
    }

    #[test]
    fn a_page_read_from_the_host_or_without_a_host_block_is_skipped_alone() {
        let mut rows = rows();
        rows.set_page("a", Row::Resident(1), 1, HOST_ONLY).unwrap();
        rows.set_page("a", Row::Host, 2, HOST_ONLY).unwrap();
        let pages: Vec<u64> = rows.mirrors("a", 0, 12).iter().map(|m| m.destination / 4).collect();
        assert_eq!(pages, vec![30]);
        // Past a row's end: nothing, as for a page that has no block yet.
        assert!(rows.mirrors("a", 12, 4).is_empty());
    }

    #[test]
    fn growth_is_caught_up_from_the_first_page_not_recorded_or_not_at_all() {
        let rows = rows();
        // (request, row, pages added, pages now, expected, why): "a" has 3 pages recorded in every row.
        let cases = [
            ("a", Row::Resident(0), 2, 5, Some(3), "two pages appended"),
            ("a", Row::Host, 1, 3, Some(3), "recorded already: nothing to add"),
            ("a", Row::Resident(1), 1, 5, None, "a page also changed, unreported"),
            ("a", Row::Resident(1), 1, 2, None, "the row shrank, unreported"),
            ("new", Row::Host, 2, 2, Some(0), "a request's first allocation"),
        ];
        for (request, row, added, now, expected, why) in cases {
            assert_eq!(rows.growth_start(request, row, added, now).unwrap(), expected, "{why}");
        }
        assert!(rows.growth_start("a", Row::Resident(2), 1, 4).is_err(), "no such group");
    }

    #[test]
    fn blocks_at_reads_every_group_page_by_page() {
        let mut rows = rows();
        rows.set_page("a", Row::Resident(1), 0, HOST_ONLY).unwrap();
        assert_eq!(rows.blocks_at("a", &[2, 0, 5]), vec![12, 22, 10, HOST_ONLY, HOST_ONLY, HOST_ONLY]);
        assert_eq!(rows.blocks_at("b", &[0]), vec![HOST_ONLY; 2]);
    }

    #[test]
    fn a_batch_scan_is_each_requests_views_in_step_order() {
        let mut rows = rows();
        rows.set("b", Row::Resident(0), vec![1, 2]).unwrap();
        rows.set("b", Row::Resident(1), vec![3, HOST_ONLY]).unwrap();
        rows.set("b", Row::Host, vec![5, 6]).unwrap();
        rows.quiet("a", 9);
        let steps = [
            Step { request: "a", handle: None, mirror_from: 3, mirror_rows: 6, end: 8 },
            Step { request: "gone", handle: None, mirror_from: 0, mirror_rows: 4, end: 4 },
            Step { request: "b", handle: None, mirror_from: 0, mirror_rows: 8, end: 8 },
            Step { request: "a", handle: None, mirror_from: 8, mirror_rows: 2, end: 10 },
        ];
        let scan = rows.scan(&steps);
        for (i, step) in steps.iter().enumerate() {
            assert_eq!(
                scan.mirrors(i, 2),
                rows.mirrors(step.request, step.mirror_from, step.mirror_rows),
                "step {i}"
            );
        }
        assert_eq!(scan.counts, vec![3, 0, 1, 1]);
        assert_eq!(scan.busy, vec![1, 2, 3], "a is quiet below 9 tokens; a request with no rows never is");
        assert!(!scan.all_resident, "b reads its page 1 from the host");
        assert!(rows.scan(&steps[..1]).all_resident && rows.scan(&[]).all_resident);
        assert_eq!(scan.handles[1], None, "no rows, no handle");

        // The same steps with the handles the scan returned: the same views.
        let kept: Vec<Step> =
            steps.iter().zip(&scan.handles).map(|(step, &handle)| Step { handle, ..*step }).collect();
        assert_eq!(rows.scan(&kept), scan);
        // "b" leaves and "c" takes its slot: b's kept handle no longer reaches it, and the name is read.
        rows.clear("b", Row::Resident(0)).unwrap();
        rows.clear("b", Row::Resident(1)).unwrap();
        rows.clear("b", Row::Host).unwrap();
        rows.set("c", Row::Host, vec![7]).unwrap();
        let b_kept = kept[2];
        let again = rows.scan(&[b_kept, Step { request: "c", ..b_kept }]);
        assert_eq!(
            (again.counts, again.busy),
            (vec![0, 0], vec![0, 1]),
            "b has no rows; c has no resident rows"
        );
        assert_eq!(again.handles[0], None);
        let c_kept = Step { request: "c", handle: again.handles[1], ..b_kept };
        assert_eq!(rows.scan(&[c_kept]).handles, again.handles[1..]);
    }

    #[test]
    fn residency_counts_pages_read_from_the_host() {
        let mut rows = rows();
        assert!(rows.all_resident("a", 12));
        assert!(!rows.all_resident("a", 13), "the step's last page has no block yet");
        rows.set_page("a", Row::Resident(0), 0, HOST_ONLY).unwrap();
        assert!(!rows.all_resident("a", 4));
        rows.set_page("a", Row::Resident(0), 0, 7).unwrap();
        assert!(rows.all_resident("a", 4));
        rows.extend("a", Row::Resident(1), &[HOST_ONLY]).unwrap();
        assert!(!rows.all_resident("a", 4));
        rows.set("a", Row::Resident(1), vec![1, 2, 3]).unwrap();
        assert!(rows.all_resident("a", 4));
        assert!(rows.all_resident("never-seen", 0) && !rows.all_resident("never-seen", 1));
    }

    #[test]
    fn rows_of_different_lengths_keep_their_own_pages() {
        let mut rows = rows();
        rows.extend("a", Row::Host, &[33, 34]).unwrap();
        rows.set("a", Row::Resident(0), vec![HOST_ONLY, 1]).unwrap();
        assert_eq!(rows.row("a", Row::Resident(0)).unwrap(), vec![HOST_ONLY, 1]);
        assert_eq!(rows.row("a", Row::Resident(1)).unwrap(), vec![20, 21, 22]);
        assert_eq!(rows.row("a", Row::Host).unwrap(), vec![30, 31, 32, 33, 34]);
        assert_eq!(
            (rows.row_len("a", Row::Host).unwrap(), rows.row_len("a", Row::Resident(0)).unwrap()),
            (5, 2)
        );
        rows.drop_page("a", 2);
        rows.drop_page("nobody", 0);
        assert_eq!(rows.blocks_at("a", &[2]), vec![HOST_ONLY, HOST_ONLY], "group 0 has no page 2 to drop");
        assert_eq!(
            (rows.row_len("a", Row::Resident(0)).unwrap(), rows.row("a", Row::Host).unwrap()[2]),
            (2, 32)
        );
        rows.set_page("a", Row::Resident(1), 2, 22).unwrap();
        assert_eq!(rows.blocks_at("a", &[1, 2]), vec![1, 21, HOST_ONLY, 22]);
        assert!(!rows.all_resident("a", 8));
        rows.set("a", Row::Resident(0), vec![5, 6, 7, 8]).unwrap();
        assert!(rows.all_resident("a", 12), "the page read from the host was replaced");
        assert!(
            rows.set_page("a", Row::Resident(1), 3, 1).is_err(),
            "group 1 has 3 pages, whatever the others hold"
        );
    }

    #[test]
    fn a_request_is_forgotten_when_its_last_row_is_cleared() {
        let mut rows = rows();
        rows.clear("a", Row::Resident(0)).unwrap();
        rows.clear("a", Row::Resident(1)).unwrap();
        assert_eq!(rows.len(), 1);
        assert!(rows.row("a", Row::Resident(0)).unwrap().is_empty());
        rows.clear("a", Row::Host).unwrap();
        assert!(rows.is_empty());
    }

    #[test]
    fn a_quiet_request_wakes_when_a_row_changes_or_its_step_reaches_the_bound() {
        let mut rows = rows();
        assert!(rows.busy("a", 10), "not marked yet");
        rows.quiet("a", 12);
        assert!(!rows.busy("a", 11) && rows.busy("a", 12));
        rows.extend("a", Row::Host, &[33]).unwrap();
        assert!(rows.busy("a", 11), "a row grew");
        rows.quiet("a", 12);
        rows.set_page("a", Row::Resident(1), 0, HOST_ONLY).unwrap();
        assert!(rows.busy("a", 11), "a page was lost");
        rows.quiet("a", 12);
        let changes = rows.changes();
        rows.wake("a");
        assert!(rows.busy("a", 11) && rows.changes() == changes, "a wake is not a row change");
        rows.quiet("never-seen", 100);
        assert!(rows.busy("never-seen", 0) && rows.len() == 1, "no rows: never quiet, nothing recorded");
    }

    #[test]
    fn bad_arguments_change_nothing() {
        let mut rows = rows();
        assert!(rows.set_page("a", Row::Resident(0), 3, 1).is_err());
        assert!(rows.set_page("b", Row::Host, 0, 1).is_err());
        assert_eq!(rows.len(), 1);
        assert!(rows.set("a", Row::Resident(2), vec![]).is_err());
        assert!(BlockRows::new(0, 4).is_err() && BlockRows::new(1, 0).is_err());
        assert!(BlockRows::new(MAX_GROUPS, 4).is_ok() && BlockRows::new(MAX_GROUPS + 1, 4).is_err());
        assert!(BlockRows::new(usize::MAX, 4).is_err());
        assert!(BlockRows::new(1, MAX_BLOCK_SIZE).is_ok() && BlockRows::new(1, MAX_BLOCK_SIZE + 1).is_err());
        assert!(rows.row("a", Row::Resident(2)).is_err() && rows.row_len("a", Row::Resident(2)).is_err());
        assert_eq!(rows.row("a", Row::Resident(0)).unwrap(), &[10, 11, 12]);
    }
}
