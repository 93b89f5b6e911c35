//! `hisparse._core`: a thin PyO3 layer over `hisparse-core`.
//!
//! Argument checks (`args`), error mapping (`errors`) and conversions only; every decision lives in the
//! core. Calls that do real work run with the GIL released. Errors become the classes of
//! `hisparse.errors` (defined in Python so they can also derive from `ValueError` / `KeyError`).

mod args;
mod block_rows;
mod errors;
mod manager;
mod page_book;
mod plan;
mod pool_policy;
mod publish_gate;
mod reference;

use std::sync::{Mutex, MutexGuard};

use pyo3::prelude::*;

use crate::args::Int;

/// The core object a frozen pyclass shares, locked. Every method of `PoolPolicy` and `BlockRows` either
/// completes or changes nothing, so a lock poisoned by a panic inside one still guards a valid state: keep
/// serving. (`ResidencyManager` refuses a poisoned lock instead.)
fn locked<T>(inner: &Mutex<T>) -> MutexGuard<'_, T> {
    inner.lock().unwrap_or_else(|e| e.into_inner())
}

/// The CUDA sources, embedded so that a wheel carries exactly what `cuda/` holds.
const KERNEL_SOURCES: [(&str, &str); 3] = [
    ("common.cuh", include_str!("../../../cuda/common.cuh")),
    ("copy.cu", include_str!("../../../cuda/copy.cu")),
    ("resolve.cu", include_str!("../../../cuda/resolve.cu")),
];

#[pyfunction]
fn kernel_sources() -> Vec<(&'static str, &'static str)> {
    KERNEL_SOURCES.to_vec()
}

/// GPU blocks one request holds in steady state under pressure (see the core's `steady_state_blocks`).
#[pyfunction]
#[pyo3(signature = (*, seq_len, block_size, hot_rows, tail_pages, groups))]
fn steady_state_blocks(
    seq_len: &Bound<'_, PyAny>,
    block_size: &Bound<'_, PyAny>,
    hot_rows: &Bound<'_, PyAny>,
    tail_pages: &Bound<'_, PyAny>,
    groups: &Bound<'_, PyAny>,
) -> PyResult<u64> {
    fn arg<T: Int>(v: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
        args::int(v, name)
    }
    let block_size: u32 = arg(block_size, "block_size")?;
    let groups = arg(groups, "groups")?;
    if block_size == 0 || groups == 0 {
        return Err(errors::invalid("block_size and groups must be positive".into()));
    }
    hisparse_core::steady_state_blocks(
        arg(seq_len, "seq_len")?,
        block_size,
        arg(hot_rows, "hot_rows")?,
        arg(tail_pages, "tail_pages")?,
        groups,
    )
    .ok_or_else(|| errors::invalid("steady_state_blocks overflows 64 bits for these sizes".into()))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<manager::ResidencyManager>()?;
    m.add_class::<plan::StepPlan>()?;
    m.add_class::<manager::Admission>()?;
    m.add_class::<pool_policy::PoolPolicy>()?;
    m.add_class::<block_rows::BlockRows>()?;
    m.add_class::<page_book::PageBook>()?;
    m.add_class::<publish_gate::PublishGate>()?;
    m.add_function(wrap_pyfunction!(block_rows::unpack_row_mirrors, m)?)?;
    m.add_class::<reference::ApplyBuffers>()?;
    m.add_function(wrap_pyfunction!(steady_state_blocks, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_sources, m)?)?;
    m.add_function(wrap_pyfunction!(reference::decode_heat_summary, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_ref_resolve, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_ref_gather, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_ref_copy, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_ref_invalidate, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_ref_apply, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_ref_heat_summary, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_encode_heat_summary, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_check_plan, m)?)?;
    m.add_function(wrap_pyfunction!(reference::_ref_slot_mapping, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
