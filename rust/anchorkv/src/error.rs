//! `Result` carrying the library's status and message.

use std::ffi::CStr;
use std::fmt;

use anchorkv_sys as sys;

/// Why a call failed: the `akv_status` codes other than `AKV_OK`, with their pinned values.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
#[repr(i32)]
pub enum Status {
    /// A NULL pointer, a bad shape, an option out of range, a wrong slice length.
    InvalidArgument = sys::AKV_ERR_INVALID_ARGUMENT,
    /// A valid request this build, backend or method cannot do.
    Unsupported = sys::AKV_ERR_UNSUPPORTED,
    /// `retain_fraction` too small: the message names the minimum.
    Budget = sys::AKV_ERR_BUDGET,
    /// The input holds NaN or infinity.
    NonFinite = sys::AKV_ERR_NON_FINITE,
    /// An allocation (or a worker thread) was refused.
    OutOfMemory = sys::AKV_ERR_OUT_OF_MEMORY,
    /// Serialized bytes failed their checks (magic, version, checksum, bounds).
    CorruptData = sys::AKV_ERR_CORRUPT_DATA,
    /// Serialized data from a newer, unknown format (or, from this crate, a library of
    /// another major version).
    Version = sys::AKV_ERR_VERSION,
    /// The backend is not compiled in or has no device.
    BackendUnavailable = sys::AKV_ERR_BACKEND_UNAVAILABLE,
    /// The backend (CUDA, cuBLAS) reported an error.
    Backend = sys::AKV_ERR_BACKEND,
    /// Handles or tensors that do not belong together.
    Mismatch = sys::AKV_ERR_MISMATCH,
    /// A buffer too small (serialize).
    Capacity = sys::AKV_ERR_CAPACITY,
    /// A bug in the library.
    Internal = sys::AKV_ERR_INTERNAL,
    /// A code this binding does not know (a newer library); `Error::code` has it.
    Unknown = -1,
}

impl Status {
    const ALL: [Status; 12] = [
        Status::InvalidArgument, Status::Unsupported, Status::Budget, Status::NonFinite,
        Status::OutOfMemory, Status::CorruptData, Status::Version, Status::BackendUnavailable,
        Status::Backend, Status::Mismatch, Status::Capacity, Status::Internal,
    ];

    /// The status of a non-zero `akv_status` code (`Unknown` for codes not listed above).
    pub fn from_code(code: i32) -> Status {
        Status::ALL.into_iter().find(|status| *status as i32 == code).unwrap_or(Status::Unknown)
    }

    /// The library's static name of the code (`akv_status_string`).
    pub fn description(code: i32) -> &'static str {
        // SAFETY: akv_status_string never returns NULL and its strings are static.
        unsafe { CStr::from_ptr(sys::akv_status_string(code)) }.to_str().unwrap_or("AKV_ERR_?")
    }
}

/// A failed call: its status, the raw code and the library's message (thread-local detail
/// read right after the call), or a message from this crate's own argument checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Error {
    status: Status,
    code: i32,
    message: String,
}

impl Error {
    /// Why the call failed.
    pub fn status(&self) -> Status {
        self.status
    }

    /// The raw `akv_status` code (also for codes `Status` does not know).
    pub fn code(&self) -> i32 {
        self.code
    }

    /// The library's detail (`akv_last_error_message`) or this crate's own.
    pub fn message(&self) -> &str {
        &self.message
    }

    /// An error raised by this crate before calling the library.
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, code: status as i32, message: message.into() }
    }

    pub(crate) fn invalid(message: impl Into<String>) -> Error {
        Error::new(Status::InvalidArgument, message)
    }

    /// The error of a failed call; must run on the calling thread right after it.
    fn last(code: i32) -> Error {
        // SAFETY: never NULL; valid until the next anchorkv call on this thread, copied now.
        let message = unsafe { CStr::from_ptr(sys::akv_last_error_message()) };
        Error { status: Status::from_code(code), code, message: message.to_string_lossy().into_owned() }
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let name = Status::description(self.code);
        let name = name.split(':').next().unwrap_or(name);
        if self.message.is_empty() {
            write!(f, "{name}")
        } else {
            write!(f, "{name}: {}", self.message)
        }
    }
}

impl std::error::Error for Error {}

/// The result of every fallible call of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// `Ok` for `AKV_OK`, the library's error otherwise.
pub(crate) fn check(code: sys::akv_status) -> Result<()> {
    if code == sys::AKV_OK {
        Ok(())
    } else {
        Err(Error::last(code))
    }
}
