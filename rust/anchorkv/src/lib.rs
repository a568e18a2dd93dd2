//! Safe Rust API of anchorkv: compress an LLM layer's KV cache at the end of prefill
//! without dropping tokens, then decode over the compressed form.
//!
//! ```no_run
//! use anchorkv::{CompressOptions, Context, Prefill, Shape};
//! # fn main() -> anchorkv::Result<()> {
//! let shape = Shape::new(1024, 2, 4, 64); // S, H, Hq, D
//! # let (keys, values, window) = (vec![0f32; 2 * 1024 * 64], vec![0f32; 2 * 1024 * 64], vec![0f32; 4 * 32 * 64]);
//! let context = Context::cpu()?;
//! let prefill = Prefill::new(shape, &keys, &values).queries(&window);
//! let cache = context.compress(&prefill, &CompressOptions::new().retain_fraction(0.1))?;
//! let out = cache.decode_to_vec(&vec![0.5f32; 4 * 64])?; // [Hq][D]
//! # Ok(()) }
//! ```
//!
//! Host buffers are slices of `f32`, [`F16`] or [`Bf16`]; device pointers (CUDA contexts) go
//! through the `unsafe` `*_raw` calls. Handles free themselves on drop; a [`Cache`] keeps its
//! context alive. Handles are `Send`, not `Sync`.

#![deny(missing_docs)]

mod cache;
mod context;
mod element;
mod error;
mod options;

use std::ffi::CStr;

pub use anchorkv_sys as sys;
pub use cache::{Cache, Reconstruction};
pub use context::{Context, Prefill, Strides};
pub use element::{Bf16, Element, F16};
pub use error::{Error, Result, Status};
pub use options::{
    compressed_size, Backend, CacheStats, CompressOptions, ContextOptions, DType, HeadStats, Method, PoolType,
    ResidualScale, RopeStyle, Shape,
};

/// Version string of the linked library.
pub fn version() -> &'static str {
    // SAFETY: a static, NUL-terminated string.
    unsafe { CStr::from_ptr(sys::akv_version_string()) }.to_str().unwrap_or("?")
}

/// MAJOR*10000 + MINOR*100 + PATCH of the linked library.
pub fn version_number() -> u32 {
    // SAFETY: no arguments, no state.
    unsafe { sys::akv_version_number() }
}

#[cfg(test)]
mod thread_traits {
    fn is_send<T: Send>() {}

    #[test]
    fn handles_are_send() {
        is_send::<crate::Context>();
        is_send::<crate::Cache>();
    }
}
