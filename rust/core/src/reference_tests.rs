use super::*;
use crate::lru_stamps::{order, stamp};

const RB: usize = 16;

/// One request row, block size 2, 4 pages, 4 hot rows (2 hot blocks), one group.
struct Fixture {
    geo: Geometry,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    host_table: Vec<i32>,
    hot_blocks: Vec<i32>,
    resident: Vec<u8>,
    hot_pos: Vec<i32>,
    hot_stamp: Vec<i64>,
    hot_clock: Vec<i64>,
    heat: Vec<i32>,
    status: Vec<i32>,
    counters: Vec<i64>,
    gpu: Vec<u8>,
    host: Vec<u8>,
}

impl Fixture {
    fn new() -> Self {
        let geo = Geometry { block_size: 2, pages: 4, hot_rows: 4, groups: 1, row_bytes: RB };
        // Pages 1 and 3 resident in blocks 3 and 5; pages 0 and 2 host-only (host blocks 1 and 2).
        // Host row `x` holds bytes equal to 100 + x.
        let host: Vec<u8> = (0..8 * RB).map(|i| 100 + (i / RB) as u8).collect();
        Fixture {
            geo,
            seq_lens: vec![7],
            block_table: vec![0, 3, 0, 5],
            host_table: vec![1, -1, 2, -1],
            hot_blocks: vec![6, 7],
            resident: Vec::new(),
            hot_pos: vec![-1; 4],
            hot_stamp: vec![0; 4],
            hot_clock: vec![0],
            heat: vec![0; 4],
            status: vec![0],
            counters: vec![0; 3],
            gpu: vec![0; 8 * 2 * RB],
            host,
        }
    }

    fn resolve(&mut self, topk: &[i32], top_k: usize, row_state: &[i32]) -> Result<Vec<i32>> {
        let mut st = ResolveState {
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            host_table: &self.host_table,
            hot_blocks: &self.hot_blocks,
            resident: &self.resident,
            hot_pos: &mut self.hot_pos,
            hot_stamp: &mut self.hot_stamp,
            hot_clock: &mut self.hot_clock,
            heat: &mut self.heat,
            status: &mut self.status,
            counters: &mut self.counters,
        };
        let mut out = vec![7; topk.len()];
        let mut layers = [LayerSlabs { gpu: &mut self.gpu, host: &mut self.host }];
        let batch = Batch { topk, top_k, row_state };
        resolve(&self.geo, &mut st, &batch, 0, &mut layers, &mut out)?;
        Ok(out)
    }
}

#[test]
fn resident_hot_and_miss_rows_resolve_as_specified() {
    let mut f = Fixture::new();
    // Positions: 2 -> page 1 resident (block 3: row 6); 0 -> page 0 miss; 4 -> page 2 miss;
    // 7 -> beyond seq_len; 0 again -> same slot; -1 padding.
    let out = f.resolve(&[2, 0, 4, 7, 0, -1], 6, &[0]).unwrap();
    // Misses take the oldest slots 0 and 1: hot rows 6*2+0 = 12 and 6*2+1 = 13.
    assert_eq!(out, vec![6, 12, 13, -1, 12, -1]);
    assert_eq!(f.hot_pos, vec![0, 4, -1, -1]);
    // U = [0 (request index 1), 4 (index 2)]: stamped with clock 1 in U's order; slots 2 and 3 keep stamp 0.
    assert_eq!(f.hot_stamp, vec![stamp(1, 1), stamp(1, 2), 0, 0]);
    assert_eq!((order(&f.hot_stamp), f.hot_clock.clone()), (vec![2, 3, 0, 1], vec![1]));
    assert_eq!(f.heat, vec![1, 1, 1, 0]);
    assert_eq!(f.counters, vec![0, 2, 2 * RB as i64]);
    // Position 0 is host row 1*2+0 = 2, position 4 is host row 2*2+0 = 4.
    assert!(f.gpu[12 * RB..13 * RB].iter().all(|&b| b == 102));
    assert!(f.gpu[13 * RB..14 * RB].iter().all(|&b| b == 104));

    // Next step: 4 hits (slot 1), 5 misses (slot 2, the oldest evictable), 1 misses (slot 3).
    let out = f.resolve(&[5, 4, 1], 3, &[0]).unwrap();
    assert_eq!(out, vec![14, 13, 15]);
    assert_eq!(f.hot_pos, vec![0, 4, 5, 1]);
    // Untouched slot 0 first, then the selected ones in order of first selection.
    assert_eq!(f.hot_stamp, vec![stamp(1, 1), stamp(2, 1), stamp(2, 0), stamp(2, 2)]);
    assert_eq!((order(&f.hot_stamp), f.hot_clock.clone()), (vec![0, 2, 1, 3], vec![2]));
    assert_eq!(f.counters, vec![1, 4, 4 * RB as i64]);
}

#[test]
fn rows_of_one_request_resolve_over_their_union_and_padding_rows_touch_nothing() {
    let mut f = Fixture::new();
    let out = f.resolve(&[0, 4, 4, 5, 9, 9], 2, &[0, 0, -1]).unwrap();
    assert_eq!(out, vec![12, 13, 13, 14, -1, -1]);
    assert_eq!(f.heat, vec![1, 0, 2, 0]);
    assert_eq!(f.counters[1], 3);
}

#[test]
fn overflow_and_missing_host_copy_fail_without_changing_state() {
    let mut f = Fixture::new();
    f.seq_lens[0] = 8;
    f.block_table = vec![0, 0, 0, 0];
    f.host_table = vec![1, 2, 3, -1];
    // Five distinct non-resident positions do not fit four hot rows.
    let out = f.resolve(&[0, 1, 2, 3, 4], 5, &[0]).unwrap();
    assert_eq!(out, vec![-1; 5]);
    assert_eq!(f.status, vec![STATUS_OVERFLOW]);
    assert_eq!((f.hot_pos.clone(), f.counters.clone()), (vec![-1; 4], vec![0; 3]));
    assert_eq!(f.heat, vec![2, 2, 1, 0], "heat counts even when the request fails");
    // Page 3 has no host copy.
    let out = f.resolve(&[6, 0], 2, &[0]).unwrap();
    assert_eq!(out, vec![-1, -1]);
    assert_eq!(f.status, vec![STATUS_OVERFLOW | STATUS_NO_HOST_COPY]);
    assert!(f.gpu.iter().all(|&b| b == 0));
}

#[test]
fn malformed_arguments_are_refused_before_any_write() {
    let mut f = Fixture::new();
    assert!(f.resolve(&[0], 1, &[1]).is_err(), "row_state beyond the state rows");
    assert!(f.resolve(&[0, 2], 1, &[0]).is_err(), "topk of the wrong length");
    assert_eq!((f.heat.clone(), f.status.clone()), (vec![0; 4], vec![0]));
    // Any negative state row is a padding row, as on the GPU.
    assert_eq!(f.resolve(&[0, 2], 1, &[-7, -1]).unwrap(), vec![-1, -1]);
    assert_eq!(f.heat, vec![0; 4]);
}

#[test]
fn a_bad_block_table_entry_is_skipped_and_flagged() {
    let mut f = Fixture::new();
    f.block_table[1] = 8; // one past the slab's last block
    f.block_table[3] = -3;
    let out = f.resolve(&[2, 0, 6, 3], 4, &[0]).unwrap();
    assert_eq!(out, vec![-1, 12, -1, -1]);
    assert_eq!(f.status, vec![STATUS_BAD_TABLE]);
    assert_eq!(f.heat, vec![1, 2, 0, 1], "heat counts every distinct valid position");
    assert_eq!(f.hot_pos, vec![0, -1, -1, -1], "the rest of the request resolves");
}

#[test]
fn a_request_flagged_resident_reads_in_place_and_never_touches_its_hot_region() {
    let mut f = Fixture::new();
    f.block_table = vec![4, 3, 2, 5];
    f.resident = vec![1];
    let out = f.resolve(&[2, 0, 4, 7, 0, -1], 6, &[0]).unwrap();
    assert_eq!(out, vec![6, 8, 4, -1, 8, -1]);
    assert_eq!((f.status.clone(), f.heat.clone()), (vec![0], vec![1, 1, 1, 0]));
    assert_eq!(
        (f.hot_pos.clone(), f.hot_clock.clone(), f.counters.clone()),
        (vec![-1; 4], vec![0], vec![0; 3])
    );
    // A flag the table contradicts: the page without a block is corrupt state (-1, BAD_TABLE), heat still
    // counts it, and no hot slot, stamp, clock or counter changes.
    let mut f = Fixture::new();
    f.resident = vec![1];
    let out = f.resolve(&[2, 0, 4, 0], 4, &[0]).unwrap();
    assert_eq!(out, vec![6, -1, -1, -1]);
    assert_eq!((f.status.clone(), f.heat.clone()), (vec![STATUS_BAD_TABLE], vec![1, 1, 1, 0]));
    assert_eq!((f.hot_pos.clone(), f.hot_stamp.clone()), (vec![-1; 4], vec![0; 4]));
    assert_eq!((f.hot_clock.clone(), f.counters.clone()), (vec![0], vec![0; 3]));
    // The flags must cover every state row.
    f.resident = vec![1, 0];
    assert!(f.resolve(&[2], 1, &[0]).is_err());
}

#[test]
fn a_seq_len_past_the_pages_is_clamped_and_flagged() {
    let mut f = Fixture::new();
    f.seq_lens[0] = 9; // 4 pages of 2 tokens hold 8
    let out = f.resolve(&[7, 8], 2, &[0]).unwrap();
    assert_eq!(out, vec![5 * 2 + 1, -1]);
    assert_eq!(f.status, vec![STATUS_BAD_TABLE]);
    f.seq_lens[0] = -1;
    assert_eq!(f.resolve(&[2], 1, &[0]).unwrap(), vec![-1]);
}

/// Resolves two misses (positions 0 and 4) and returns what changed, or `None` when nothing but heat
/// and status did.
fn hot_state_after(f: &mut Fixture) -> Option<(Vec<i32>, Vec<i64>)> {
    let state =
        |f: &Fixture| (f.hot_pos.clone(), f.hot_stamp.clone(), f.hot_clock.clone(), f.counters.clone());
    let before = (state(f), f.gpu.clone());
    let out = f.resolve(&[0, 4], 2, &[0]).unwrap();
    if out == vec![-1, -1] {
        assert_eq!(before, (state(f), f.gpu.clone()));
        return None;
    }
    Some((f.hot_pos.clone(), f.hot_stamp.clone()))
}

/// A named corruption of a fresh fixture and the status it must raise.
type Corruption = (&'static str, fn(&mut Fixture), i32);

#[test]
fn corrupt_hot_state_fails_the_request_without_writes() {
    let cases: [Corruption; 5] = [
        ("hot block 8 (== GPU blocks)", |f| f.hot_blocks[1] = 8, STATUS_BAD_HOT),
        ("hot block 0 after the first", |f| f.hot_blocks[1] = 0, STATUS_BAD_HOT),
        ("one hot block twice", |f| f.hot_blocks[1] = 6, STATUS_BAD_HOT),
        ("a selected position in two slots", |f| f.hot_pos = vec![4, -1, 4, -1], STATUS_BAD_HOT),
        ("host block past the pool", |f| f.host_table[2] = 4, STATUS_BAD_TABLE),
    ];
    for (what, corrupt, status) in cases {
        let mut f = Fixture::new();
        corrupt(&mut f);
        assert_eq!(hot_state_after(&mut f), None, "{what}");
        assert_eq!(f.status, vec![status], "{what}");
        assert_eq!(f.heat, vec![1, 0, 1, 0], "{what}: heat counts anyway");
    }
}

#[test]
fn a_duplicate_that_is_not_selected_is_harmless() {
    let mut f = Fixture::new();
    f.hot_pos = vec![5, -1, 5, -1];
    f.hot_stamp = vec![7, -5, 8, -5]; // LRU order 1, 3 (a tie: by slot), 0, 2
    let (pos, stamps) = hot_state_after(&mut f).unwrap();
    assert_eq!((pos, stamps), (vec![5, 0, 5, 4], vec![7, stamp(1, 0), 8, stamp(1, 1)]));
    assert_eq!(f.status, vec![0]);
}

#[test]
fn every_stamp_is_a_legal_state_and_ties_go_by_slot() {
    // The extremes and a tie: LRU order 0, 2 (MIN, by slot), 3, 1. Misses 0 and 4 take slots 0 and 2.
    let mut f = Fixture::new();
    f.hot_stamp = vec![i64::MIN, i64::MAX, i64::MIN, -1];
    f.hot_clock = vec![41];
    let want = (vec![0, -1, 4, -1], vec![stamp(42, 0), i64::MAX, stamp(42, 1), -1]);
    assert_eq!(hot_state_after(&mut f), Some(want));
    assert_eq!((f.status.clone(), f.hot_clock.clone()), (vec![0], vec![42]));
}

#[test]
fn missing_and_bad_host_copies_both_flag() {
    let mut f = Fixture::new();
    f.host_table = vec![-1, -1, 9, -1];
    assert_eq!(hot_state_after(&mut f), None);
    assert_eq!(f.status, vec![STATUS_NO_HOST_COPY | STATUS_BAD_TABLE]);
}

#[test]
fn invalidate_empties_slots_and_moves_them_to_the_front_in_slot_order() {
    let geo = Geometry { block_size: 2, pages: 4, hot_rows: 4, groups: 1, row_bytes: RB };
    let mut pos = vec![7, 3, 9, 1];
    let mut stamps = vec![11, 13, 10, 12]; // LRU order 2, 0, 3, 1
    invalidate(&geo, &mut pos, &mut stamps, &[0, 1, 0, 9, -1, 3, 0, 9, 0, -5]).unwrap();
    assert_eq!(pos, vec![7, 3, -1, -1]);
    assert_eq!(stamps, vec![11, 13, 9, 9]);
    assert_eq!(order(&stamps), vec![2, 3, 0, 1]);
}

#[test]
fn invalidate_empties_every_duplicate_in_every_group() {
    let geo = Geometry { block_size: 2, pages: 4, hot_rows: 4, groups: 2, row_bytes: RB };
    // Row 0 group 0 holds 5 twice; group 1 holds the smallest stamp there is.
    let mut pos = vec![5, 2, 5, 6, 5, 8, -1, 2];
    let mut stamps = vec![3, 2, 1, 0, i64::MIN, 7, 7, 0];
    invalidate(&geo, &mut pos, &mut stamps, &[0, 5, 0, 2]).unwrap();
    assert_eq!(pos, vec![-1, -1, -1, 6, -1, 8, -1, -1]);
    // Group 0: one below its smallest (0). Group 1: i64::MIN already, so the emptied slots tie with it.
    assert_eq!(stamps, vec![-1, -1, -1, 0, i64::MIN, 7, 7, i64::MIN]);
    assert!(invalidate(&geo, &mut pos, &mut stamps, &[1, 5]).is_err(), "state row 1 of 1");
}

#[test]
fn copies_and_gather_move_whole_rows() {
    let mut gpu = vec![0u8; 4 * RB];
    let mut host: Vec<u8> = (0..4 * RB).map(|i| (i / RB) as u8 + 1).collect();
    let mut layers = [LayerSlabs { gpu: &mut gpu, host: &mut host }];
    copy_units(&[1, 0, -1, 3], 2, RB, Direction::HostToDevice, &mut layers).unwrap();
    assert!(copy_units(&[2, 0], 2, RB, Direction::HostToDevice, &mut layers).is_err());
    let before = layers[0].gpu.to_vec();
    let twice = copy_units(&[1, 0, 1, 1], 1, RB, Direction::HostToDevice, &mut layers);
    assert!(twice.unwrap_err().to_string().contains("destinations must be distinct"));
    assert_eq!(layers[0].gpu, &before[..]);
    copy_units(&[0, 1, 1, 1], 1, RB, Direction::HostToDevice, &mut layers).unwrap();
    let mut dense = vec![9u8; 3 * RB];
    assert!(gather(&[2, -1, 4], &gpu, RB, &mut dense).is_err(), "row 4 of 4");
    gather(&[2, -1, 3], &gpu, RB, &mut dense).unwrap();
    assert!(dense[..RB].iter().all(|&b| b == 1));
    assert!(dense[RB..2 * RB].iter().all(|&b| b == 0));
    assert!(dense[2 * RB..].iter().all(|&b| b == 2));
}
