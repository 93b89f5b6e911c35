//! One match from a core error to its Python class. The classes live in `hisparse.errors` (Python, so they
//! can also derive from `ValueError` / `KeyError`); PyO3 imports each once and caches it.

use hisparse_core::{CoreError, Resource};
use pyo3::prelude::*;

pyo3::import_exception!(hisparse.errors, ConfigError);
pyo3::import_exception!(hisparse.errors, CapacityError);
pyo3::import_exception!(hisparse.errors, InvalidArgumentError);
pyo3::import_exception!(hisparse.errors, UnknownRequestError);
pyo3::import_exception!(hisparse.errors, InvariantError);

pub fn to_pyerr(e: CoreError) -> PyErr {
    let message = e.to_string();
    match e {
        CoreError::Config(_) => ConfigError::new_err(message),
        CoreError::InvalidArgument(_) => InvalidArgumentError::new_err(message),
        CoreError::Invariant(_) => InvariantError::new_err(message),
        CoreError::UnknownRequest(id) => {
            let err = UnknownRequestError::new_err(message);
            Python::attach(|py| err.value(py).setattr("request_id", id).map(|_| err))
                .unwrap_or_else(|setattr_err| setattr_err)
        }
        CoreError::Capacity { resource, needed, available, .. } => {
            let err = CapacityError::new_err(message);
            let name = match resource {
                Resource::GpuBlocks => "gpu",
                Resource::HostBlocks => "host",
                Resource::RequestSlots => "slots",
            };
            Python::attach(|py| {
                let v = err.value(py);
                v.setattr("resource", name)?;
                v.setattr("needed", needed)?;
                v.setattr("available", available)?;
                Ok(err)
            })
            .unwrap_or_else(|setattr_err: PyErr| setattr_err)
        }
    }
}

/// An argument error, named after the argument.
pub fn invalid(message: String) -> PyErr {
    InvalidArgumentError::new_err(message)
}

pub trait PyResultExt<T> {
    fn py(self) -> PyResult<T>;
}

impl<T> PyResultExt<T> for hisparse_core::Result<T> {
    fn py(self) -> PyResult<T> {
        self.map_err(to_pyerr)
    }
}
