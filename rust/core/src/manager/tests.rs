use std::collections::HashMap;

use proptest::prelude::*;

use super::*;
use crate::config::test_config;
use crate::plan::Transition;

/// A worker that moves content tags the way the GPU data path moves bytes, and mirrors the block tables
/// from plans alone. A page's tag is its prefix hash when it has one, else unique to (request, page).
struct World {
    gpu: Vec<Option<u64>>,
    host: Vec<Option<u64>>,
    tables: HashMap<u32, Vec<(u32, i32)>>,
    hot: HashMap<u32, Vec<u32>>,
    /// Each row's resident flag, from the plans' length entries (cleared rows: not resident).
    resident: HashMap<u32, bool>,
    in_flight: Vec<TransferId>,
    hashes: HashMap<u64, Vec<u64>>,
    /// The restores and scheduled tokens of the last plan applied (what a worker dying may not have done).
    last: (Vec<crate::plan::Restore>, Vec<Scheduled>),
}

fn tag(world: &World, id: u64, page: u32) -> u64 {
    match world.hashes.get(&id).and_then(|h| h.get(page as usize)) {
        Some(&h) => h,
        None => (1 << 62) | (id << 16) | page as u64,
    }
}

impl World {
    fn new(cfg: &Config) -> Self {
        World {
            gpu: vec![None; cfg.num_gpu_blocks as usize],
            host: vec![None; cfg.num_host_blocks as usize],
            tables: HashMap::new(),
            hot: HashMap::new(),
            resident: HashMap::new(),
            in_flight: Vec::new(),
            hashes: HashMap::new(),
            last: (Vec::new(), Vec::new()),
        }
    }

    /// Applies a plan in the documented order, then writes the step's new tokens.
    fn apply(&mut self, m: &ResidencyManager, plan: &StepPlan, scheduled: &[(u64, u32)], old_lens: &[u32]) {
        let pages = m.config().max_pages() as usize;
        // Every plan the manager makes passes the worker's check (ranges, one entry per place, distinct
        // copy destinations) and survives its encoding.
        let c = m.config();
        let geo = crate::worker::WorkerGeometry {
            pages,
            block_size: c.block_size as usize,
            groups: c.num_index_groups as usize,
            hot_rows: c.hot_rows as usize,
            row_bytes: 16,
        };
        let (gpu, host) = (c.num_gpu_blocks as usize, c.num_host_blocks as usize);
        crate::worker::check_plan(plan, c.max_running as usize, &geo, gpu, host).unwrap();
        assert_eq!(&StepPlan::decode(&plan.encode()).unwrap(), plan);
        for &row in &plan.cleared_rows {
            self.tables.insert(row, vec![(0, -1); pages]);
            self.hot.remove(&row);
            self.resident.remove(&row);
        }
        for l in &plan.seq_lens {
            self.resident.insert(l.row, l.resident);
        }
        for u in &plan.table_updates {
            self.tables.entry(u.row).or_insert_with(|| vec![(0, -1); pages])[u.page as usize] =
                (u.gpu_block, u.host_block);
        }
        for h in &plan.hot_updates {
            self.hot.insert(h.row, h.blocks.clone());
        }
        let mut targets: Vec<u32> = plan.restores.iter().map(|c| c.gpu_block).collect();
        targets.sort_unstable();
        targets.dedup();
        assert_eq!(targets.len(), plan.restores.len(), "two restores into one block: {:?}", plan.restores);
        for c in &plan.restores {
            let owned = m.request_ids().into_iter().any(|id| {
                m.request_info(id).unwrap().row.is_some()
                    && m.block_table(id).unwrap().contains(&(c.gpu_block, c.host_block as i32))
            });
            assert!(owned, "restore {c:?} is no running page's current entry");
            self.gpu[c.gpu_block as usize] = self.host[c.host_block as usize];
        }
        for c in &plan.materialize {
            self.host[c.host_block as usize] = self.gpu[c.gpu_block as usize];
            self.in_flight.push(c.transfer);
        }
        self.last = (plan.restores.clone(), plan.scheduled.clone());
        let bs = m.config().block_size;
        for (&(id, tokens), &old) in scheduled.iter().zip(old_lens) {
            let row = m.request_info(id).unwrap().row.unwrap();
            for page in old / bs..(old + tokens).div_ceil(bs) {
                let block = self.tables[&row][page as usize].0;
                assert_ne!(block, 0, "request {id} writes page {page} through the null block");
                self.gpu[block as usize] = Some(tag(self, id, page));
            }
        }
    }

    /// The worker dies before the last plan's restores and tokens landed: their blocks hold garbage. Only
    /// where they are still that page's (a request that left since gave its blocks to others, whose content
    /// a dying worker did not touch).
    fn lose_last_step(&mut self, m: &ResidencyManager) {
        let (restores, scheduled) = std::mem::take(&mut self.last);
        let current = |g: u32, h: i32| {
            m.request_ids().into_iter().any(|id| {
                m.request_info(id).unwrap().row.is_some() && m.block_table(id).unwrap().contains(&(g, h))
            })
        };
        for c in restores {
            if current(c.gpu_block, c.host_block as i32) {
                self.gpu[c.gpu_block as usize] = Some(u64::MAX);
            }
        }
        let bs = m.config().block_size;
        for s in scheduled {
            let Ok(info) = m.request_info(s.request) else { continue };
            if info.row != Some(s.row) || info.seq_len != s.start + s.tokens {
                continue;
            }
            let table = m.block_table(s.request).unwrap();
            for page in s.start / bs..(s.start + s.tokens).div_ceil(bs) {
                let block = table[page as usize].0;
                if block != 0 {
                    self.gpu[block as usize] = Some(u64::MAX);
                }
            }
        }
    }

    /// Every written page of every running request reads back its own content, and the mirrored tables
    /// equal the manager's.
    fn check(&self, m: &ResidencyManager) {
        for id in m.request_ids() {
            let info = m.request_info(id).unwrap();
            let Some(row) = info.row else { continue };
            let table = m.block_table(id).unwrap();
            let mirrored = self.tables.get(&row).map_or(&[][..], |t| &t[..table.len()]);
            assert_eq!(mirrored, &table[..], "request {id}: plan-built table differs");
            assert_eq!(self.hot.get(&row).cloned().unwrap_or_default(), m.hot_blocks(id).unwrap());
            // The flag resolve trusts: set exactly when every page of the request has a GPU block.
            let resident = table.iter().all(|&(gpu, _)| gpu != 0);
            assert_eq!(
                self.resident.get(&row).copied().unwrap_or(false),
                resident,
                "request {id}: resident flag"
            );
            for (page, &(gpu, host)) in table.iter().enumerate() {
                let want = Some(tag(self, id, page as u32));
                let got = if gpu != 0 { self.gpu[gpu as usize] } else { self.host[host as usize] };
                assert_eq!(got, want, "request {id} page {page} (gpu {gpu}, host {host}) lost its content");
            }
        }
    }
}

#[derive(Clone, Debug)]
enum Op {
    Admit {
        family: u64,
        prompt: u32,
        extra: u32,
    },
    Step {
        mask: u8,
        tokens: u32,
    },
    Complete {
        pick: u8,
        ok: bool,
    },
    Finish(usize),
    Preempt(usize),
    Resume(usize),
    Heat(usize, u32),
    /// The worker is rebuilt (`redo`: before the last plan's results came back).
    Rebuild {
        redo: bool,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0..3u64, 1..24u32, 0..24u32).prop_map(|(family, prompt, extra)| Op::Admit { family, prompt, extra }),
        6 => (any::<u8>(), 1..10u32).prop_map(|(mask, tokens)| Op::Step { mask, tokens }),
        4 => (any::<u8>(), prop::bool::weighted(0.8)).prop_map(|(pick, ok)| Op::Complete { pick, ok }),
        1 => (0..8usize).prop_map(Op::Finish),
        1 => (0..8usize).prop_map(Op::Preempt),
        1 => (0..8usize).prop_map(Op::Resume),
        1 => (0..8usize, any::<u32>()).prop_map(|(i, s)| Op::Heat(i, s)),
        1 => any::<bool>().prop_map(|redo| Op::Rebuild { redo }),
    ]
}

fn run(cfg: Config, ops: Vec<Op>) {
    let mut m = ResidencyManager::new(cfg.clone()).unwrap();
    let mut w = World::new(&cfg);
    let mut next_id = 1u64;
    for op in ops {
        let ids = m.request_ids();
        match op {
            Op::Admit { family, prompt, extra } => {
                let id = next_id;
                next_id += 1;
                // Requests of one family share their prompt's page hashes (a common prefix).
                let hashes: Vec<u64> =
                    (0..prompt / cfg.block_size).map(|p| family * 1000 + p as u64 + 1).collect();
                w.hashes.insert(id, hashes.clone());
                match m.admit(id, prompt, &hashes, Some(prompt + extra + 8)) {
                    Ok(a) => assert!(a.cached_tokens < prompt),
                    Err(CoreError::Capacity { .. }) => {}
                    Err(e) => panic!("admit failed: {e}"),
                }
            }
            Op::Step { mask, tokens } => {
                let mut scheduled = Vec::new();
                let mut old = Vec::new();
                for (i, &id) in ids.iter().enumerate() {
                    let info = m.request_info(id).unwrap();
                    if mask & (1 << (i % 8)) == 0 || info.row.is_none() {
                        continue;
                    }
                    let room = m.req(id).unwrap().max_len - info.seq_len;
                    if room > 0 {
                        scheduled.push((id, tokens.min(room)));
                        old.push(info.seq_len);
                    }
                }
                let before = m.stats();
                let plan = m.plan_step(&scheduled).unwrap();
                if plan.is_short() {
                    assert_eq!(m.stats(), before, "a short step changed the state");
                    assert!(plan.table_updates.is_empty() && plan.materialize.is_empty());
                } else {
                    w.apply(&m, &plan, &scheduled, &old);
                    w.check(&m);
                }
            }
            Op::Complete { pick, ok } => {
                let chosen: Vec<TransferId> = w
                    .in_flight
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| pick & (1 << (i % 8)) != 0)
                    .map(|(_, &t)| t)
                    .collect();
                w.in_flight.retain(|t| !chosen.contains(t));
                m.complete(&chosen, ok).unwrap();
                assert!(m.complete(&chosen[..chosen.len().min(1)], ok).is_err() || chosen.is_empty());
            }
            Op::Finish(i) if !ids.is_empty() => m.finish(ids[i % ids.len()]).unwrap(),
            Op::Preempt(i) if !ids.is_empty() => {
                let id = ids[i % ids.len()];
                let _ = m.preempt(id);
            }
            Op::Resume(i) if !ids.is_empty() => {
                let id = ids[i % ids.len()];
                match m.resume(id) {
                    Ok(_) | Err(CoreError::Capacity { .. }) | Err(CoreError::InvalidArgument(_)) => {}
                    Err(e) => panic!("resume failed: {e}"),
                }
            }
            Op::Heat(i, seed) if !ids.is_empty() => {
                let id = ids[i % ids.len()];
                let n = m.request_info(id).unwrap().num_pages as usize;
                let pages: Vec<u32> = (0..n as u32).filter(|p| (seed >> (p % 32)) & 1 == 1).collect();
                let mut summary = HeatSummary::default();
                let ranked: Vec<(u32, u32)> =
                    pages.iter().map(|p| (1 + (seed >> ((p + 7) % 32)) % 3, *p)).collect();
                let (coldest, hottest) = ranked.split_at(ranked.len() / 2);
                summary.push(id, coldest.to_vec(), hottest.to_vec());
                m.apply_results(&[], &[], &summary).unwrap();
            }
            Op::Rebuild { redo } => {
                if redo {
                    w.lose_last_step(&m);
                }
                let lost = std::mem::take(&mut w.in_flight);
                w.tables.clear();
                w.hot.clear();
                w.resident.clear();
                let plan = m.resync(redo).unwrap();
                assert_eq!(plan.cleared_rows, (0..cfg.max_running).collect::<Vec<_>>());
                for t in &lost {
                    assert!(m.complete(&[*t], true).is_err(), "transfer {t} of the dead worker was accepted");
                }
                let scheduled: Vec<(u64, u32)> =
                    plan.scheduled.iter().map(|s| (s.request, s.tokens)).collect();
                let old: Vec<u32> = plan.scheduled.iter().map(|s| s.start).collect();
                w.apply(&m, &plan, &scheduled, &old);
                w.check(&m);
            }
            _ => {}
        }
        m.check_invariants().unwrap_or_else(|e| panic!("after {op:?}: {e}"));
    }
}

proptest! {
    // 256 cases by default; PROPTEST_CASES=20000 for a long run.
    #[test]
    fn state_machine_keeps_invariants_and_content(
        gpu in 14..48u32,
        host in 16..96u32,
        policy in prop::sample::select(vec![PressurePolicy::Coldest, PressurePolicy::Fifo, PressurePolicy::Resident]),
        ops in prop::collection::vec(op(), 1..80),
        admission_pages in prop::sample::select(vec![0u32, 8, 17]),
    ) {
        let mut cfg = test_config(gpu, host);
        cfg.policy = policy;
        cfg.admission_pages = admission_pages;
        run(cfg, ops);
    }
}

fn small() -> ResidencyManager {
    ResidencyManager::new(test_config(24, 64)).unwrap()
}

/// Drives `id` by `tokens` per step for `steps` steps, completing every copy at once.
fn decode(m: &mut ResidencyManager, ids: &[u64], tokens: u32, steps: usize) -> Vec<StepPlan> {
    let mut plans = Vec::new();
    for _ in 0..steps {
        let sched: Vec<(u64, u32)> = ids.iter().map(|&id| (id, tokens)).collect();
        let plan = m.plan_step(&sched).unwrap();
        let done: Vec<u64> = plan.materialize.iter().map(|c| c.transfer).collect();
        m.complete(&done, true).unwrap();
        m.check_invariants().unwrap();
        plans.push(plan);
    }
    plans
}

#[test]
fn config_refuses_a_host_pool_smaller_than_one_request() {
    let err = ResidencyManager::new(test_config(24, 15)).err().unwrap();
    let CoreError::Config(msg) = err else { panic!("{err:?}") };
    assert!(msg.contains("host_pool_gib) to at least 16 blocks"), "{msg}");
}

#[test]
fn pressure_moves_requests_to_mixed_residency() {
    let mut m = small();
    m.admit(1, 4, &[], None).unwrap();
    m.admit(2, 4, &[], None).unwrap();
    // 23 usable blocks, watermark 2, hot region 2, tail 2: two requests of 14 pages cannot both stay full.
    let plans = decode(&mut m, &[1, 2], 4, 14);
    assert!(plans.iter().all(|p| !p.is_short()));
    let transitions: Vec<_> = plans.iter().flat_map(|p| p.transitions.clone()).collect();
    assert!(
        transitions.iter().any(|t| t.from == Residency::Full && t.to != Residency::Full),
        "{transitions:?}"
    );
    assert!(plans.iter().map(|p| p.released_pages).sum::<u32>() > 0);
    assert!(m.stats().mixed + m.stats().none >= 1, "{}", m.capacity_log());
    m.finish(2).unwrap();
    decode(&mut m, &[1], 0, 1);
}

#[test]
fn short_step_says_how_many_blocks_are_missing() {
    let mut m = small();
    m.admit(1, 60, &[], None).unwrap();
    m.admit(2, 48, &[], None).unwrap();
    assert!(!m.plan_step(&[(1, 60)]).unwrap().is_short());
    let before = m.stats();
    // 15 of 23 blocks are taken by dirty pages nobody may release; request 2 needs 12.
    let plan = m.plan_step(&[(2, 48)]).unwrap();
    assert_eq!(plan.missing_blocks, 12 - 8);
    assert_eq!(m.stats(), before);
}

/// Request `id` writes 21 tokens whose pages hash to `hashes`, they are copied and published, and it ends.
fn publish_and_finish(m: &mut ResidencyManager, id: u64, hashes: &[u64]) {
    m.admit(id, 21, hashes, None).unwrap();
    decode(m, &[id], 21, 1);
    decode(m, &[id], 1, 2);
    m.finish(id).unwrap();
}

/// Others take every free block, so the GPU copies of `hashes` are reused and the prefix is on the host
/// only; then `id` is admitted from it.
fn admit_from_host_only_prefix(m: &mut ResidencyManager, id: u64, hashes: &[u64]) -> Admission {
    m.admit(3, 48, &[], None).unwrap();
    m.admit(5, 40, &[], None).unwrap();
    assert!(!m.plan_step(&[(3, 48), (5, 40)]).unwrap().is_short());
    m.finish(3).unwrap();
    m.finish(5).unwrap();
    m.admit(id, 21, hashes, None).unwrap()
}

#[test]
fn prefix_from_host_starts_with_no_residency_and_adopts_gpu_copies() {
    let mut m = small();
    let hashes: Vec<u64> = (1..=5).collect();
    publish_and_finish(&mut m, 1, &hashes);
    // The GPU copies are still readable: a new request adopts them without any copy.
    let a = m.admit(2, 21, &hashes, None).unwrap();
    assert_eq!(a.cached_tokens, 20);
    assert_eq!(a.residency, Residency::Full);
    assert_eq!(a.restored_pages, 0);
    let plan = m.plan_step(&[(2, 1)]).unwrap();
    assert!(plan.restores.is_empty());
    m.finish(2).unwrap();
    let a = admit_from_host_only_prefix(&mut m, 4, &hashes);
    assert_eq!(a.cached_tokens, 20);
    assert_eq!(a.residency, Residency::None);
    assert_eq!(m.request_info(4).unwrap().hot_blocks, 2);
    // The admission queued the restores of its two tail pages; the next plan carries them.
    assert_eq!(a.restored_pages, 2);
    // The pool is empty otherwise: the tail (restored at admission) and, as relief, the other three come back.
    let plan = m.plan_step(&[(4, 1)]).unwrap();
    assert_eq!(plan.restores.len(), 5);
    let t = |from, to| Transition { request: 4, from, to };
    assert_eq!(
        plan.transitions,
        vec![t(Residency::None, Residency::Mixed), t(Residency::Mixed, Residency::Full)]
    );
    assert_eq!(m.request_info(4).unwrap().hot_blocks, 0);
    m.check_invariants().unwrap();
}

#[test]
fn a_request_that_never_fills_its_admission_window_comes_back_restored_whole() {
    let mut cfg = test_config(24, 64);
    // max_model_len 64 is 16 pages of 4 tokens: no request fills a window of 17.
    cfg.admission_pages = 17;
    let mut m = ResidencyManager::new(cfg).unwrap();
    let hashes: Vec<u64> = (1..=5).collect();
    publish_and_finish(&mut m, 1, &hashes);
    let a = admit_from_host_only_prefix(&mut m, 4, &hashes);
    assert_eq!((a.cached_tokens, a.residency, a.restored_pages), (20, Residency::Full, 5));
    assert_eq!(m.request_info(4).unwrap().hot_blocks, 0);
    // Before it has run, pressure does not move it to a hot region: 18 blocks are free, the step takes 17
    // and the watermark asks for 2 more, and only its restored pages could be released.
    m.admit(6, 60, &[], None).unwrap();
    m.admit(7, 8, &[], None).unwrap();
    let plan = m.plan_step(&[(6, 60), (7, 8)]).unwrap();
    assert!(!plan.is_short());
    assert_eq!(plan.restores.len(), 5);
    let info = m.request_info(4).unwrap();
    assert_eq!((info.released_pages, info.host_only_pages, info.hot_blocks), (0, 0, 0));
    m.check_invariants().unwrap();
    // Nor in the step that first reads them (the last free block takes its next page).
    assert!(!m.plan_step(&[(4, 1)]).unwrap().is_short());
    assert_eq!(m.request_info(4).unwrap().hot_blocks, 0);
    // Once it has run, it is a resident request like any other: the next pressure moves it.
    assert!(!m.plan_step(&[(4, 1), (6, 1)]).unwrap().is_short());
    assert_eq!(m.request_info(4).unwrap().hot_blocks, 2);
    m.check_invariants().unwrap();
}

#[test]
fn a_window_of_no_pages_keeps_a_returning_request_tiered() {
    let mut m = small();
    let hashes: Vec<u64> = (1..=5).collect();
    publish_and_finish(&mut m, 1, &hashes);
    let a = admit_from_host_only_prefix(&mut m, 4, &hashes);
    assert_eq!((a.residency, a.restored_pages), (Residency::None, 2));
}

#[test]
fn preempted_request_resumes_from_host_without_recompute() {
    let mut m = small();
    m.admit(1, 17, &[], None).unwrap();
    decode(&mut m, &[1], 17, 1);
    decode(&mut m, &[1], 1, 2);
    let kept = m.preempt(1).unwrap();
    assert_eq!(kept, 16);
    assert_eq!(m.stats().running, 0);
    assert!(m.plan_step(&[(1, 1)]).is_err());
    let a = m.resume(1).unwrap();
    assert_eq!(a.cached_tokens, 16);
    m.check_invariants().unwrap();
}

#[test]
fn a_rebuilt_worker_gets_the_whole_state_and_the_lost_step_again() {
    let mut m = small();
    let hashes: Vec<u64> = (1..=5).collect();
    publish_and_finish(&mut m, 1, &hashes);
    admit_from_host_only_prefix(&mut m, 4, &hashes);
    m.admit(2, 9, &[], None).unwrap();
    let lost = m.plan_step(&[(4, 1), (2, 9)]).unwrap();
    assert_eq!(lost.restores.len(), 5);
    // The worker died before the step's results: its restores and tokens come again, with every row's state.
    let plan = m.resync(true).unwrap();
    assert_eq!(plan.cleared_rows, (0..m.config().max_running).collect::<Vec<_>>());
    assert_eq!((&plan.restores, &plan.scheduled), (&lost.restores, &lost.scheduled));
    assert_eq!(plan.seq_lens.len(), 2);
    let pages = |m: &ResidencyManager, id| m.request_info(id).unwrap().num_pages as usize;
    assert_eq!(plan.table_updates.len(), pages(&m, 4) + pages(&m, 2));
    // A worker rebuilt after a step's results gets the state, not the step; copies in flight start again.
    let next = m.plan_step(&[(4, 1), (2, 1)]).unwrap();
    assert!(!next.materialize.is_empty());
    let again = m.resync(false).unwrap();
    assert!(again.scheduled.is_empty() && again.restores.is_empty());
    let copied = |p: &StepPlan| p.materialize.iter().map(|c| (c.gpu_block, c.transfer)).collect::<Vec<_>>();
    let (old, new) = (copied(&next), copied(&again));
    assert_eq!(old.iter().map(|c| c.0).collect::<Vec<_>>(), new.iter().map(|c| c.0).collect::<Vec<_>>());
    assert!(new.iter().all(|&(_, t)| old.iter().all(|&(_, o)| t > o)));
    assert!(m.complete(&[old[0].1], true).is_err());
    m.complete(&[new[0].1], true).unwrap();
    m.check_invariants().unwrap();
}

#[test]
fn bad_input_is_refused_and_changes_nothing() {
    let mut m = small();
    m.admit(1, 4, &[], None).unwrap();
    assert!(matches!(m.admit(1, 4, &[], None), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(m.admit(2, 0, &[], None), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(m.plan_step(&[(9, 1)]), Err(CoreError::UnknownRequest(9))));
    assert!(matches!(m.plan_step(&[(1, 1), (1, 1)]), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(m.plan_step(&[(1, 1000)]), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(m.complete(&[77], true), Err(CoreError::InvalidArgument(_))));
    let ragged =
        HeatSummary { requests: vec![1], offsets: vec![0, 1], cold: vec![1], pages: vec![0], heat: vec![] };
    assert!(matches!(m.apply_results(&[], &[], &ragged), Err(CoreError::InvalidArgument(_))));
    assert!(matches!(m.finish(5), Err(CoreError::UnknownRequest(5))));
    m.check_invariants().unwrap();
}

#[test]
fn admission_names_the_binding_resource() {
    let mut m = ResidencyManager::new(test_config(24, 40)).unwrap();
    m.admit(1, 4, &[], Some(64)).unwrap();
    m.admit(2, 4, &[], Some(64)).unwrap();
    match m.admit(3, 4, &[], Some(64)) {
        Err(CoreError::Capacity { resource: Resource::HostBlocks, .. }) => {}
        other => panic!("{other:?}"),
    }
    // 13 usable blocks, 4 per running request that may read through a hot region (tail 2 + region 2), 2 (its
    // tail, as plain residency keeps) per request too short ever to take one (4 pages: 2 outside the tail).
    for (max_len, admitted) in [(64, 3), (16, 6)] {
        let mut m = ResidencyManager::new(test_config(14, 400)).unwrap();
        for id in 0..admitted {
            m.admit(id, 4, &[], Some(max_len)).unwrap();
        }
        match m.admit(admitted, 4, &[], Some(max_len)) {
            Err(CoreError::Capacity { resource: Resource::GpuBlocks, .. }) => {}
            other => panic!("{other:?}"),
        }
        m.check_invariants().unwrap();
    }
}

#[test]
fn hashes_added_later_make_generated_pages_reusable() {
    let mut m = small();
    m.admit(1, 8, &[11, 12], None).unwrap();
    decode(&mut m, &[1], 8, 1);
    decode(&mut m, &[1], 4, 3); // pages 2 and 3 of generated tokens are written and copied
    m.add_page_hashes(1, &[13, 14]).unwrap();
    assert!(m.add_page_hashes(1, &[0; 20]).is_err());
    m.finish(1).unwrap();
    let a = m.admit(2, 17, &[11, 12, 13, 14], None).unwrap();
    assert_eq!(a.cached_tokens, 16);
    m.check_invariants().unwrap();
}

fn coldest_setup() -> ResidencyManager {
    // 40 blocks of 16 tokens, top_k 16: a hot region of 32 rows is 2 blocks; the watermark is 4.
    let mut cfg = test_config(40, 64);
    (cfg.block_size, cfg.max_model_len, cfg.top_k, cfg.hot_rows, cfg.watermark) = (16, 512, 16, 32, 4);
    let mut m = ResidencyManager::new(cfg).unwrap();
    m.admit(1, 320, &[], None).unwrap();
    m.plan_step(&[(1, 320)]).unwrap();
    let copies: Vec<u64> = m.plan_step(&[(1, 1)]).unwrap().materialize.iter().map(|c| c.transfer).collect();
    m.complete(&copies, true).unwrap(); // 20 complete pages are clean on the host
    m
}

fn released(m: &ResidencyManager, id: u64) -> Vec<usize> {
    let states = m.page_states(id).unwrap();
    states.iter().enumerate().filter(|(_, s)| **s == "released").map(|(i, _)| i).collect()
}

#[test]
fn coldest_releases_what_the_latest_summary_ranks_coldest() {
    let mut m = coldest_setup();
    let mut summary = HeatSummary::default();
    // The first ten pages were selected, the rest never: the never-selected ones go first.
    summary.push(1, (10..20).map(|p| (0, p)).collect(), vec![]);
    m.apply_results(&[], &[], &summary).unwrap();
    m.admit(2, 256, &[], None).unwrap();
    let plan = m.plan_step(&[(2, 256)]).unwrap(); // 16 of 18 free blocks taken, watermark 4: four pages go
    assert_eq!(plan.released_pages, 4);
    assert_eq!(released(&m, 1), [10, 11, 12, 13]);
    // The table updates flag every page the policy may release, and unflag the released ones.
    let flags: HashMap<u32, bool> =
        plan.table_updates.iter().filter(|u| u.row == 0).map(|u| (u.page, u.releasable)).collect();
    assert_eq!((10..14).map(|p| flags[&p]).collect::<Vec<_>>(), [false; 4]);
    m.check_invariants().unwrap();
}

#[test]
fn old_heat_fades_and_the_once_hot_pages_go_first_again() {
    let mut m = coldest_setup();
    let mut old = HeatSummary::default();
    old.push(1, (10..20).map(|p| (0, p)).collect(), (0..10).map(|p| (5, p)).collect());
    m.apply_results(&[], &[], &old).unwrap();
    // Later summaries: the first ten decayed to 0 (nobody selected them since), the others are selected now.
    let mut now = HeatSummary::default();
    now.push(1, (0..10).map(|p| (0, p)).collect(), (10..20).map(|p| (2, p)).collect());
    m.apply_results(&[], &[], &now).unwrap();
    m.admit(2, 256, &[], None).unwrap();
    m.plan_step(&[(2, 256)]).unwrap();
    assert_eq!(released(&m, 1), [0, 1, 2, 3]);
    m.check_invariants().unwrap();
}

#[test]
fn a_refused_report_changed_nothing_and_can_be_sent_again() {
    let mut m = small();
    m.admit(1, 16, &[], None).unwrap();
    m.plan_step(&[(1, 16)]).unwrap();
    let copies: Vec<u64> = m.plan_step(&[(1, 1)]).unwrap().materialize.iter().map(|c| c.transfer).collect();
    assert!(copies.len() >= 2);
    let before = m.page_states(1).unwrap();
    for (completed, failed) in
        [(&copies[..1], &[999][..]), (&copies[..1], &copies[..1]), (&copies[..], &[][..])]
    {
        let bad_heat = HeatSummary { requests: vec![1, 1], offsets: vec![0, 0, 0], ..HeatSummary::default() };
        let heat = if failed.is_empty() { bad_heat } else { HeatSummary::default() };
        assert!(matches!(m.apply_results(completed, failed, &heat), Err(CoreError::InvalidArgument(_))));
        assert_eq!(m.page_states(1).unwrap(), before);
        m.check_invariants().unwrap();
    }
    m.apply_results(&copies[1..], &copies[..1], &HeatSummary::default()).unwrap();
    assert_eq!(m.stats().pending_transfers, 0);
    m.check_invariants().unwrap();
}
