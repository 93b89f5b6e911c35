//! One error type for the whole core. Each variant maps onto one Python exception class, so callers can
//! tell a bad configuration from a full pool from a bug without parsing messages.

use std::fmt;

/// The resource that refused an admission or a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resource {
    GpuBlocks,
    HostBlocks,
    RequestSlots,
}

impl fmt::Display for Resource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Resource::GpuBlocks => "GPU blocks",
            Resource::HostBlocks => "host blocks",
            Resource::RequestSlots => "request slots",
        })
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CoreError {
    /// The configuration cannot work; the message says what to change.
    Config(String),
    /// Not enough of a resource right now; state is unchanged.
    Capacity { resource: Resource, needed: u64, available: u64, message: String },
    /// A caller passed something that cannot be right (unknown id, bad shape, out-of-range block...).
    InvalidArgument(String),
    /// A request id the manager does not know (or no longer knows).
    UnknownRequest(u64),
    /// An internal invariant does not hold: a bug in hisparse, never the caller's fault.
    Invariant(String),
}

impl fmt::Display for CoreError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CoreError::Config(m) | CoreError::InvalidArgument(m) | CoreError::Invariant(m) => f.write_str(m),
            CoreError::Capacity { message, .. } => f.write_str(message),
            CoreError::UnknownRequest(id) => write!(f, "unknown request id {id}"),
        }
    }
}

impl std::error::Error for CoreError {}

pub type Result<T> = std::result::Result<T, CoreError>;

/// Shorthand for argument errors, which are the common case at the API boundary.
pub(crate) fn invalid<T>(message: impl Into<String>) -> Result<T> {
    Err(CoreError::InvalidArgument(message.into()))
}

pub(crate) fn invariant<T>(message: impl Into<String>) -> Result<T> {
    Err(CoreError::Invariant(message.into()))
}
