//! The one validation layer for arguments coming from Python. Integers must be integers (a Python `int`,
//! or anything with `__index__` such as a NumPy integer; never a `bool` or a `float`), in the range the core
//! takes; anything else is an `InvalidArgumentError` that names the argument. Nothing is truncated, wrapped
//! or cast silently.

use pyo3::exceptions::{PyException, PyOverflowError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyByteArray, PyBytes, PyFloat, PyInt, PyString, PyTuple};

use crate::errors::invalid;

/// The integer types the core takes, with the range an argument of that type accepts.
pub trait Int: Sized {
    const RANGE: &'static str;
    fn from_i128(v: i128) -> Option<Self>;
}

macro_rules! int_type {
    ($t:ty, $range:expr) => {
        impl Int for $t {
            const RANGE: &'static str = $range;
            fn from_i128(v: i128) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
        }
    };
}

int_type!(u32, "0..2**32");
int_type!(u64, "0..2**64");
int_type!(usize, "0..2**64");
int_type!(i64, "-2**63..2**63");

/// A page hash: a `u64` or an `i64` (Python's `hash()` is negative half the time); negative values are
/// their two's complement bits.
pub struct Hash(pub u64);

impl Int for Hash {
    const RANGE: &'static str = "-2**63..2**64";
    fn from_i128(v: i128) -> Option<Self> {
        if let Ok(u) = u64::try_from(v) {
            Some(Hash(u))
        } else {
            i64::try_from(v).ok().map(|i| Hash(i as u64))
        }
    }
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "?".into())
}

/// The integer value of `v`, as an i128 so that both the i64 and the u64 range are representable. `name`
/// is only called to word an error (elements of long sequences are named lazily).
fn integer(v: &Bound<'_, PyAny>, name: &dyn Fn() -> String) -> PyResult<i128> {
    if v.is_instance_of::<PyBool>() || v.is_instance_of::<PyFloat>() {
        return Err(invalid(format!("{} must be an integer, not {} ({v})", name(), type_name(v))));
    }
    match v.extract::<i64>() {
        Ok(i) => Ok(i as i128),
        Err(e) if e.is_instance_of::<PyOverflowError>(v.py()) => match v.extract::<u64>() {
            Ok(u) => Ok(u as i128),
            Err(_) => Err(invalid(format!("{} = {v} is outside every range hisparse takes", name()))),
        },
        Err(e) if e.is_instance_of::<PyTypeError>(v.py()) => {
            Err(invalid(format!("{} must be an integer, not {}", name(), type_name(v))))
        }
        // Its own `__index__` raised an error: the value has no integer to give (an interrupt stays one).
        Err(e) if e.is_instance_of::<PyException>(v.py()) => {
            let error = invalid(format!("{} = {v} gives no integer: {e}", name()));
            error.set_cause(v.py(), Some(e));
            Err(error)
        }
        Err(e) => Err(e),
    }
}

fn convert<T: Int>(v: &Bound<'_, PyAny>, name: &dyn Fn() -> String) -> PyResult<T> {
    let i = integer(v, name)?;
    T::from_i128(i).ok_or_else(|| invalid(format!("{} = {i} is outside {}", name(), T::RANGE)))
}

pub fn int<T: Int>(v: &Bound<'_, PyAny>, name: &str) -> PyResult<T> {
    convert(v, &|| name.to_string())
}

/// [`int`] with its name worded only for an error: for values read per request on a hot path.
pub fn int_named<T: Int>(v: &Bound<'_, PyAny>, name: &dyn Fn() -> String) -> PyResult<T> {
    convert(v, name)
}

pub fn opt_int<T: Int>(v: Option<&Bound<'_, PyAny>>, name: &str) -> PyResult<Option<T>> {
    match v {
        Some(v) if !v.is_none() => int(v, name).map(Some),
        _ => Ok(None),
    }
}

/// A float of any value, NaN and infinities included, for a setting whose range the core's configuration
/// checks (an int is fine too).
pub fn number(v: &Bound<'_, PyAny>, name: &str) -> PyResult<f64> {
    if v.is_instance_of::<PyBool>() {
        return Err(invalid(format!("{name} must be a number, not bool")));
    }
    match v.extract::<f64>() {
        // An int past a float's range is a number all the same, infinite as a float: the configuration's to
        // refuse, as it refuses the infinities.
        Err(e) if e.is_instance_of::<PyOverflowError>(v.py()) && v.is_instance_of::<PyInt>() => {
            Ok(if v.gt(0)? { f64::INFINITY } else { f64::NEG_INFINITY })
        }
        Err(_) => Err(invalid(format!("{name} must be a number, not {}", type_name(v)))),
        Ok(x) => Ok(x),
    }
}

pub fn boolean(v: &Bound<'_, PyAny>, name: &str) -> PyResult<bool> {
    v.cast::<PyBool>()
        .map(|b| b.is_true())
        .map_err(|_| invalid(format!("{name} must be True or False, not {v}")))
}

/// Refuses a string where a sequence is meant (a `str` is iterable, and would be taken apart).
fn sequence<'py>(v: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, pyo3::types::PyIterator>> {
    if v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() || v.is_instance_of::<PyByteArray>() {
        return Err(invalid(format!("{name} must be a sequence, not {}", type_name(v))));
    }
    v.try_iter().map_err(|_| invalid(format!("{name} must be a sequence, not {}", type_name(v))))
}

/// More elements than any call takes (a pool holds at most 2^28 blocks; a step schedules at most 2^20
/// requests): longer sequences are refused while they are read, never allocated for.
const MAX_ELEMENTS: usize = 1 << 24;

/// Room for the elements of `v`: its length as a hint, bounded, so that a lying or huge `__len__` cannot
/// make the allocation abort the process.
fn room<T>(v: &Bound<'_, PyAny>) -> Vec<T> {
    Vec::with_capacity(v.len().unwrap_or(0).min(1 << 12))
}

fn too_long(name: &str) -> PyErr {
    invalid(format!("{name} has more than {MAX_ELEMENTS} elements"))
}

/// Each element of the sequence `v` read by `read(index, element)`, refused past [`MAX_ELEMENTS`].
fn elements<'py, T>(
    v: &Bound<'py, PyAny>,
    name: &str,
    mut read: impl FnMut(usize, Bound<'py, PyAny>) -> PyResult<T>,
) -> PyResult<Vec<T>> {
    let mut out = room(v);
    for (i, item) in sequence(v, name)?.enumerate() {
        if i == MAX_ELEMENTS {
            return Err(too_long(name));
        }
        out.push(read(i, item?)?);
    }
    Ok(out)
}

pub fn ints<T: Int>(v: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<T>> {
    elements(v, name, |i, item| convert(&item, &|| format!("{name}[{i}]")))
}

/// A sequence of integers or ``None`` (e.g. a row's block ids, ``None`` where a page has no block).
pub fn opt_ints<T: Int>(v: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<Option<T>>> {
    elements(v, name, |i, item| {
        if item.is_none() {
            return Ok(None);
        }
        convert(&item, &|| format!("{name}[{i}]")).map(Some)
    })
}

/// A sequence of strings (e.g. request ids), not one string taken apart.
pub fn strings(v: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<String>> {
    elements(v, name, |i, item| {
        let text = item
            .cast::<PyString>()
            .map_err(|_| invalid(format!("{name}[{i}] must be a str, not {}", type_name(&item))))?;
        Ok(text.to_str()?.to_owned())
    })
}

/// A sequence of pairs of integers, e.g. `[(request_id, new_tokens), ...]`.
pub fn pairs<A: Int, B: Int>(v: &Bound<'_, PyAny>, name: &str, what: (&str, &str)) -> PyResult<Vec<(A, B)>> {
    elements(v, name, |i, item| {
        let not_a_pair =
            || invalid(format!("{name}[{i}] must be a pair ({}, {}), not {item}", what.0, what.1));
        // Tuples, what engines pass, are read in place; any other pair-like sequence is iterated.
        let (a, b) = match item.cast::<PyTuple>() {
            Ok(t) if t.len() == 2 => (t.get_item(0)?, t.get_item(1)?),
            Ok(_) => return Err(not_a_pair()),
            Err(_) => {
                // Three at most: enough to tell a pair from anything else, whatever the item's length.
                let pair: Vec<Bound<'_, PyAny>> =
                    sequence(&item, &format!("{name}[{i}]"))?.take(3).collect::<PyResult<_>>()?;
                let [a, b] = <[_; 2]>::try_from(pair).map_err(|_| not_a_pair())?;
                (a, b)
            }
        };
        Ok((
            convert(&a, &|| format!("{name}[{i}] {}", what.0))?,
            convert(&b, &|| format!("{name}[{i}] {}", what.1))?,
        ))
    })
}

/// Bytes as given (`bytes` or `bytearray`), copied out while the GIL is held.
pub fn bytes(v: &Bound<'_, PyAny>, name: &str) -> PyResult<Vec<u8>> {
    if let Ok(b) = v.cast::<PyBytes>() {
        return Ok(b.as_bytes().to_vec());
    }
    if let Ok(b) = v.cast::<PyByteArray>() {
        return Ok(b.to_vec());
    }
    Err(invalid(format!("{name} must be bytes, not {}", type_name(v))))
}
