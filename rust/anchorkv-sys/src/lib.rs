//! Raw declarations of `include/anchorkv/anchorkv.h`, one for one.
//!
//! Everything here is `unsafe` to call and follows the header's rules (ownership, host vs
//! device pointers, streams). Use the `anchorkv` crate for a safe API. C enums are plain
//! `c_int` type aliases with constants (as libgit2-sys does), so a value from a newer library
//! is never undefined behaviour.
#![allow(non_camel_case_types)]
#![cfg_attr(not(test), no_std)]

use core::ffi::{c_char, c_double, c_float, c_int, c_uint, c_void};
use core::marker::{PhantomData, PhantomPinned};

// ---- Export and version ---------------------------------------------------------------------

pub const AKV_VERSION_MAJOR: u32 = 0;
pub const AKV_VERSION_MINOR: u32 = 2;
pub const AKV_VERSION_PATCH: u32 = 0;
pub const AKV_VERSION_NUMBER: u32 = AKV_VERSION_MAJOR * 10000 + AKV_VERSION_MINOR * 100 + AKV_VERSION_PATCH;
pub const AKV_VERSION_STRING: &str = "0.2.0";

// ---- Enumerations ---------------------------------------------------------------------------

pub type akv_status = c_int;
pub const AKV_OK: akv_status = 0;
pub const AKV_ERR_INVALID_ARGUMENT: akv_status = 1;
pub const AKV_ERR_UNSUPPORTED: akv_status = 2;
pub const AKV_ERR_BUDGET: akv_status = 3;
pub const AKV_ERR_NON_FINITE: akv_status = 4;
pub const AKV_ERR_OUT_OF_MEMORY: akv_status = 5;
pub const AKV_ERR_CORRUPT_DATA: akv_status = 6;
pub const AKV_ERR_VERSION: akv_status = 7;
pub const AKV_ERR_BACKEND_UNAVAILABLE: akv_status = 8;
pub const AKV_ERR_BACKEND: akv_status = 9;
pub const AKV_ERR_MISMATCH: akv_status = 10;
pub const AKV_ERR_CAPACITY: akv_status = 11;
pub const AKV_ERR_INTERNAL: akv_status = 12;

pub type akv_dtype = c_int;
pub const AKV_DTYPE_AUTO: akv_dtype = 0;
pub const AKV_DTYPE_F32: akv_dtype = 1;
pub const AKV_DTYPE_F16: akv_dtype = 2;
pub const AKV_DTYPE_BF16: akv_dtype = 3;

pub type akv_backend = c_int;
pub const AKV_BACKEND_CPU: akv_backend = 0;
pub const AKV_BACKEND_CUDA: akv_backend = 1;

pub type akv_method = c_int;
pub const AKV_METHOD_FULLKV: akv_method = 0;
pub const AKV_METHOD_ANCHORKV: akv_method = 1;
pub const AKV_METHOD_SNAPKV: akv_method = 2;
pub const AKV_METHOD_PYRAMIDKV: akv_method = 3;
pub const AKV_METHOD_ADAKV: akv_method = 4;
pub const AKV_METHOD_ANDPRO: akv_method = 5;
pub const AKV_METHOD_QUANTIZED: akv_method = 6;
pub const AKV_METHOD_TOVA: akv_method = 7;
pub const AKV_METHOD_KNORM: akv_method = 8;
pub const AKV_METHOD_STREAMINGLLM: akv_method = 9;

pub type akv_rope_style = c_int;
pub const AKV_ROPE_NONE: akv_rope_style = 0;
pub const AKV_ROPE_NEOX: akv_rope_style = 1;
pub const AKV_ROPE_GPTJ: akv_rope_style = 2;

pub type akv_pool_type = c_int;
pub const AKV_POOL_AVG: akv_pool_type = 0;
pub const AKV_POOL_MAX: akv_pool_type = 1;

pub type akv_residual_scale = c_int;
pub const AKV_SCALE_LEAST_SQUARES: akv_residual_scale = 0;
pub const AKV_SCALE_RMS: akv_residual_scale = 1;
pub const AKV_SCALE_ABSMAX: akv_residual_scale = 2;

// ---- Opaque handles (the nomicon pattern: unsized-like, !Send, !Sync, !Unpin) --------------

#[repr(C)]
pub struct akv_context {
    _private: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

#[repr(C)]
pub struct akv_cache {
    _private: [u8; 0],
    _marker: PhantomData<(*mut u8, PhantomPinned)>,
}

// ---- Structures -----------------------------------------------------------------------------

#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct akv_allocator {
    pub alloc: Option<unsafe extern "C" fn(user_data: *mut c_void, bytes: usize) -> *mut c_void>,
    pub free: Option<unsafe extern "C" fn(user_data: *mut c_void, ptr: *mut c_void, bytes: usize)>,
    pub user_data: *mut c_void,
}

#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct akv_context_options {
    pub struct_size: usize,
    pub backend: akv_backend,
    pub device: i32,
    pub num_threads: i32,
    pub allocator: akv_allocator,
}

#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct akv_rope {
    pub style: akv_rope_style,
    pub rotary_dim: i32,
    pub base: c_double,
    pub inv_freq: *const c_float,
}

#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct akv_compress_options {
    pub struct_size: usize,
    pub method: akv_method,
    pub retain_fraction: c_double,
    pub window: i32,
    pub anchors: i32,
    pub scored_fraction: c_double,
    pub pool_kernel: i32,
    pub pool_type: akv_pool_type,
    pub residual_scale: akv_residual_scale,
    pub seed: u64,
    pub layer_index: i32,
    pub layer_count: i32,
    pub rope: akv_rope,
    pub keys_post_rope: i32,
    pub softmax_scale: c_float,
    pub storage_dtype: akv_dtype,
    // Baseline methods (appended after the AnchorKV fields).
    pub adakv_alpha: c_double,
    pub quant_bits: i32,
    pub quant_outliers: i32,
    pub pyramid_beta: i32,
    pub andpro_chunk: i32,
    // AnchorKV beyond the paper (appended in 0.2).
    pub sink_tokens: i32,
    pub fill_budget: i32,
    pub anchor_share: c_double,
    pub guard_fraction: c_double,
    pub coverage_rounds: i32,
    // Tensor parallelism (appended in 0.2).
    pub pool_heads: i32,
    pub head_offset: i32,
    // Long generations (appended in 0.2).
    pub compact_after: i64,
    // Storage format (appended in 0.3).
    pub storage_format: i32,
    // Scoring (appended in 0.3).
    pub scored_min: i32,
    pub follow_tokens: i32,
    // Decode (appended in 0.3).
    pub logit_correction: f64,
}

#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct akv_shape {
    pub seq_len: i64,
    pub num_kv_heads: i32,
    pub num_q_heads: i32,
    pub head_dim: i32,
}

#[repr(C)]
#[derive(Debug, Copy, Clone)]
pub struct akv_prefill {
    pub struct_size: usize,
    pub shape: akv_shape,
    pub dtype: akv_dtype,
    pub keys: *const c_void,
    pub values: *const c_void,
    pub queries: *const c_void,
    pub positions: *const i32,
    pub kv_head_stride: i64,
    pub kv_token_stride: i64,
    pub q_head_stride: i64,
    pub q_token_stride: i64,
    // Paged keys and values (appended in 0.2).
    pub block_table: *const i32,
    pub block_size: i32,
    pub num_blocks: i32,
    pub kv_block_stride: i64,
}

#[repr(C)]
#[derive(Debug, Copy, Clone, Default)]
pub struct akv_cache_stats {
    pub struct_size: usize,
    pub method: akv_method,
    pub shape: akv_shape,
    pub storage_dtype: akv_dtype,
    pub window: i32,
    pub anchors: i32,
    pub appended_tokens: i64,
    pub append_capacity: i64,
    pub full_bytes: u64,
    pub budget_bytes: u64,
    pub base_bytes: u64,
    pub compressed_bytes: u64,
    pub appended_bytes: u64,
    pub allocated_bytes: u64,
    pub ratio: c_double,
    pub key_residuals: i64,
    pub value_residuals: i64,
    pub compactions: i64,
    // Appended in 0.3.
    pub storage_format: i32,
    pub segment_tokens: i32,
}

#[repr(C)]
#[derive(Debug, Copy, Clone, Default, PartialEq, Eq)]
pub struct akv_head_stats {
    pub kept_tokens: i64,
    pub anchors: i64,
    pub key_residuals: i64,
    pub value_residuals: i64,
}

// ---- Functions ------------------------------------------------------------------------------

extern "C" {
    pub fn akv_version_number() -> c_uint;
    pub fn akv_version_string() -> *const c_char;

    pub fn akv_status_string(status: akv_status) -> *const c_char;
    pub fn akv_last_error_message() -> *const c_char;

    pub fn akv_context_options_init(options: *mut akv_context_options);
    pub fn akv_context_create(options: *const akv_context_options, out_context: *mut *mut akv_context) -> akv_status;
    pub fn akv_context_destroy(context: *mut akv_context);

    pub fn akv_compress_options_init(options: *mut akv_compress_options);
    pub fn akv_compress_options_init_method(options: *mut akv_compress_options, method: akv_method);
    pub fn akv_compress_options_init_paper(options: *mut akv_compress_options);
    pub fn akv_prefill_init(prefill: *mut akv_prefill);
    pub fn akv_compressed_size(options: *const akv_compress_options, shape: *const akv_shape, out_bytes: *mut usize) -> akv_status;
    pub fn akv_compressed_size_model(
        options: *const akv_compress_options,
        shape: *const akv_shape,
        num_layers: i32,
        retain_fractions: *const c_double,
        out_layer_bytes: *mut usize,
        out_total_bytes: *mut usize,
    ) -> akv_status;
    pub fn akv_compress(
        context: *mut akv_context,
        prefill: *const akv_prefill,
        options: *const akv_compress_options,
        out_cache: *mut *mut akv_cache,
        stream: *mut c_void,
    ) -> akv_status;
    pub fn akv_cache_destroy(cache: *mut akv_cache);

    pub fn akv_cache_reserve(cache: *mut akv_cache, tokens: i64, stream: *mut c_void) -> akv_status;
    pub fn akv_append(
        cache: *mut akv_cache,
        keys: *const c_void,
        values: *const c_void,
        dtype: akv_dtype,
        num_tokens: i32,
        positions: *const i32,
        stream: *mut c_void,
    ) -> akv_status;
    pub fn akv_decode(
        cache: *mut akv_cache,
        queries: *const c_void,
        dtype: akv_dtype,
        q_len: i32,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> akv_status;
    pub fn akv_decode_batch(
        context: *mut akv_context,
        caches: *const *mut akv_cache,
        batch: i32,
        queries: *const c_void,
        dtype: akv_dtype,
        q_len: i32,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> akv_status;

    pub fn akv_cache_stats_get(cache: *const akv_cache, out_stats: *mut akv_cache_stats) -> akv_status;
    pub fn akv_cache_head_stats(cache: *const akv_cache, out_heads: *mut akv_head_stats) -> akv_status;
    pub fn akv_cache_reconstruct(
        cache: *const akv_cache,
        dtype: akv_dtype,
        rotated: i32,
        keys: *mut c_void,
        values: *mut c_void,
        present: *mut u8,
        stream: *mut c_void,
    ) -> akv_status;
    pub fn akv_cache_logit_penalty(cache: *const akv_cache, out: *mut f32, stream: *mut c_void) -> akv_status;

    pub fn akv_cache_serialized_size(cache: *const akv_cache, out_bytes: *mut usize) -> akv_status;
    pub fn akv_cache_serialize(
        cache: *const akv_cache,
        buffer: *mut c_void,
        capacity: usize,
        out_written: *mut usize,
        stream: *mut c_void,
    ) -> akv_status;
    pub fn akv_cache_deserialize(
        context: *mut akv_context,
        buffer: *const c_void,
        size: usize,
        out_cache: *mut *mut akv_cache,
        stream: *mut c_void,
    ) -> akv_status;

    // Decode with each row's log-sum-exp (out_lse: f32 [batch][Hq][q_len], may be null).
    pub fn akv_decode_lse(
        cache: *mut akv_cache,
        queries: *const c_void,
        dtype: akv_dtype,
        q_len: i32,
        out: *mut c_void,
        out_lse: *mut f32,
        stream: *mut c_void,
    ) -> akv_status;
    pub fn akv_decode_batch_lse(
        context: *mut akv_context,
        caches: *const *mut akv_cache,
        batch: i32,
        queries: *const c_void,
        dtype: akv_dtype,
        q_len: i32,
        out: *mut c_void,
        out_lse: *mut f32,
        stream: *mut c_void,
    ) -> akv_status;
    // Fold the appended suffix (all but its last window tokens) into the compressed form.
    pub fn akv_cache_compact(
        cache: *mut akv_cache,
        queries: *const c_void,
        dtype: akv_dtype,
        headroom_tokens: i64,
        stream: *mut c_void,
    ) -> akv_status;
}

#[cfg(test)]
mod layout {
    use super::*;

    /// Sizes, alignments, field offsets and enum values against the C compiler's view of the
    /// header (generated by build.rs from a probe program; see there).
    #[test]
    fn ffi_layout_matches_the_header() {
        include!(concat!(env!("OUT_DIR"), "/layout_checks.rs"));
    }

    #[test]
    fn loaded_library_reports_a_compatible_version() {
        let number = unsafe { akv_version_number() };
        assert_eq!(number / 10000, AKV_VERSION_MAJOR);
        assert!(number >= AKV_VERSION_NUMBER);
        let text = unsafe { core::ffi::CStr::from_ptr(akv_version_string()) }.to_str().unwrap();
        let parts: Vec<u32> = text.split('.').map(|part| part.parse().unwrap()).collect();
        assert_eq!(parts[0] * 10000 + parts[1] * 100 + parts[2], number);
    }

    #[test]
    fn options_init_sets_struct_size() {
        let mut options = core::mem::MaybeUninit::<akv_compress_options>::zeroed();
        unsafe { akv_compress_options_init(options.as_mut_ptr()) };
        let options = unsafe { options.assume_init() };
        assert_eq!(options.struct_size, core::mem::size_of::<akv_compress_options>());
        assert_eq!(options.method, AKV_METHOD_ANCHORKV);
    }
}
