//! `Cache`: one compressed layer of one request.

use std::cell::Cell;
use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use anchorkv_sys as sys;

use crate::context::{Context, ContextHandle};
use crate::element::Element;
use crate::error::{check, Error, Result, Status};
use crate::options::{Backend, CacheStats, DType, HeadStats, Shape};

/// A compressed KV cache (`akv_cache`), destroyed on drop.
///
/// Holds its context through an `Arc`, so it cannot outlive the C context. `Send` but not
/// `Sync`: a cache moves between threads but is used by one at a time; different caches of
/// one context may be used concurrently.
///
/// ```compile_fail
/// fn shared<T: Sync>(_: &T) {}
/// fn check(cache: &anchorkv::Cache) { shared(cache) } // Cache is not Sync
/// ```
pub struct Cache {
    raw: NonNull<sys::akv_cache>,
    _context: Arc<ContextHandle>, // held, not read: dropped after `raw` is destroyed (Drop runs first)
    backend: Backend,
    shape: Shape,
    _not_sync: PhantomData<Cell<()>>,
}

// SAFETY: the C API lets a cache be used from any thread, one thread at a time; !Sync (the
// PhantomData) keeps shared references on one thread.
unsafe impl Send for Cache {}

impl fmt::Debug for Cache {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Cache")
            .field("backend", &self.backend)
            .field("shape", &self.shape)
            .field("raw", &self.raw)
            .finish()
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        // SAFETY: owned handle from akv_compress/akv_cache_deserialize, destroyed once.
        unsafe { sys::akv_cache_destroy(self.raw.as_ptr()) }
    }
}

/// Dense keys, values and presence flags of every cached token (`akv_cache_reconstruct`).
#[derive(Debug, Clone)]
pub struct Reconstruction<T> {
    /// T = S + appended tokens.
    pub tokens: usize,
    /// `[H][T][D]`, post-RoPE when reconstructed `rotated`.
    pub keys: Vec<T>,
    /// `[H][T][D]`.
    pub values: Vec<T>,
    /// `[H][T]`: 1 where the method keeps the token.
    pub present: Vec<u8>,
}

impl Cache {
    pub(crate) fn adopt(context: &Context, raw: *mut sys::akv_cache) -> Result<Cache> {
        let raw = NonNull::new(raw).ok_or_else(|| Error::new(Status::Internal, "the library returned a NULL cache"))?;
        let mut cache = Cache {
            raw,
            _context: Arc::clone(&context.handle),
            backend: context.backend(),
            shape: Shape::new(0, 0, 0, 0),
            _not_sync: PhantomData,
        };
        cache.shape = cache.stats()?.shape;
        Ok(cache)
    }

    /// The C handle, for calls through `anchorkv-sys`. Stays owned by this Cache.
    pub fn as_raw(&self) -> *mut sys::akv_cache {
        self.raw.as_ptr()
    }

    /// The shape of the compressed prompt (S is the prompt length; see `num_tokens`).
    pub fn shape(&self) -> Shape {
        self.shape
    }

    /// Byte accounting and counts (`akv_cache_stats_get`).
    pub fn stats(&self) -> Result<CacheStats> {
        let mut raw = sys::akv_cache_stats {
            struct_size: std::mem::size_of::<sys::akv_cache_stats>(),
            ..Default::default()
        };
        // SAFETY: valid cache and out struct with its size set.
        check(unsafe { sys::akv_cache_stats_get(self.as_raw(), &mut raw) })?;
        Ok(CacheStats::from_raw(&raw))
    }

    /// What each KV head keeps, `[H]` (`akv_cache_head_stats`).
    pub fn head_stats(&self) -> Result<Vec<HeadStats>> {
        let mut heads = vec![HeadStats::default(); self.shape.num_kv_heads];
        // SAFETY: H entries, as the header requires.
        check(unsafe { sys::akv_cache_head_stats(self.as_raw(), heads.as_mut_ptr()) })?;
        Ok(heads)
    }

    /// Cached tokens: prompt positions plus appended tokens.
    pub fn num_tokens(&self) -> Result<usize> {
        Ok(self.shape.seq_len + self.stats()?.appended_tokens.max(0) as usize)
    }

    /// Room for `tokens` appended tokens in total, so append/decode never allocate.
    pub fn reserve(&mut self, tokens: usize) -> Result<()> {
        let tokens = i64::try_from(tokens).map_err(|_| Error::invalid("tokens too large"))?;
        // SAFETY: valid cache; CPU contexts ignore the stream.
        check(unsafe { sys::akv_cache_reserve(self.as_raw(), tokens, ptr::null_mut()) })
    }

    fn require_host_memory(&self) -> Result<()> {
        if self.backend == Backend::Cpu {
            Ok(())
        } else {
            Err(Error::new(Status::Mismatch, "host slices were given to a CUDA cache; use the unsafe *_raw calls"))
        }
    }

    /// Append new tokens exactly: keys and values `[H][n][D]`, optional positions `[n]`
    /// (strictly increasing, above every stored position; default: continue).
    pub fn append<T: Element>(&mut self, keys: &[T], values: &[T], positions: Option<&[i32]>) -> Result<()> {
        self.require_host_memory()?;
        let row = self.shape.num_kv_heads * self.shape.head_dim;
        if keys.is_empty() || keys.len() % row != 0 || values.len() != keys.len() {
            return Err(Error::invalid(format!(
                "keys and values must hold H*n*D elements (a multiple of {row}); got {} and {}",
                keys.len(),
                values.len()
            )));
        }
        let tokens = keys.len() / row;
        if let Some(positions) = positions {
            if positions.len() != tokens {
                return Err(Error::invalid(format!("positions must hold {tokens} entries; got {}", positions.len())));
            }
        }
        let tokens = i32::try_from(tokens).map_err(|_| Error::invalid("too many tokens"))?;
        // SAFETY: host slices of checked lengths.
        unsafe {
            self.append_raw(
                keys.as_ptr().cast(),
                values.as_ptr().cast(),
                T::DTYPE,
                tokens,
                positions.map_or(ptr::null(), |p| p.as_ptr()),
                ptr::null_mut(),
            )
        }
    }

    /// `akv_append` with raw pointers (device memory on CUDA; positions are host memory).
    ///
    /// # Safety
    /// keys and values must hold `H*num_tokens*D` elements of `dtype` in the backend's memory
    /// space; positions is NULL or `num_tokens` host entries.
    pub unsafe fn append_raw(
        &mut self,
        keys: *const c_void,
        values: *const c_void,
        dtype: DType,
        num_tokens: i32,
        positions: *const i32,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::akv_append(self.as_raw(), keys, values, dtype as i32, num_tokens, positions, stream))
    }

    /// q_len of a host decode whose queries and out hold `queries` and `out` elements
    /// (`[Hq][q_len][D]` each); an error for a CUDA cache or lengths that do not fit.
    fn host_q_len(&self, queries: usize, out: usize) -> Result<i32> {
        self.require_host_memory()?;
        let row = self.shape.num_q_heads * self.shape.head_dim;
        if queries == 0 || queries % row != 0 || out != queries {
            return Err(Error::invalid(format!(
                "queries and out must hold Hq*q_len*D elements (a multiple of {row}); got {queries} and {out}"
            )));
        }
        i32::try_from(queries / row).map_err(|_| Error::invalid("q_len too large"))
    }

    /// Attention of new queries over the whole cache: queries and out `[Hq][q_len][D]`
    /// (query i is the token at position T - q_len + i: causal among the new tokens).
    pub fn decode<T: Element>(&self, queries: &[T], out: &mut [T]) -> Result<()> {
        let q_len = self.host_q_len(queries.len(), out.len())?;
        // SAFETY: host slices of checked lengths.
        unsafe { self.decode_raw(queries.as_ptr().cast(), T::DTYPE, q_len, out.as_mut_ptr().cast(), ptr::null_mut()) }
    }

    /// `decode`, and each output row's log-sum-exp (`akv_decode_lse`): `lse` holds `Hq*q_len`
    /// values, the natural log of the row's softmax denominator over the tokens it attends to
    /// (logits scaled by the cache's softmax_scale). With it, attention over this cache merges
    /// with attention over other tokens: weights `exp(lse_a - m)` and `exp(lse_b - m)`.
    pub fn decode_with_lse<T: Element>(&self, queries: &[T], out: &mut [T], lse: &mut [f32]) -> Result<()> {
        let q_len = self.host_q_len(queries.len(), out.len())?;
        let rows = queries.len() / self.shape.head_dim;
        if lse.len() != rows {
            return Err(Error::invalid(format!("lse must hold Hq*q_len = {rows} values; got {}", lse.len())));
        }
        // SAFETY: host slices of checked lengths.
        check(unsafe {
            sys::akv_decode_lse(
                self.as_raw(),
                queries.as_ptr().cast(),
                T::DTYPE as i32,
                q_len,
                out.as_mut_ptr().cast(),
                lse.as_mut_ptr(),
                ptr::null_mut(),
            )
        })
    }

    /// Folds the appended tokens, except the last `window`, back into the compressed form
    /// (`akv_cache_compact`; AnchorKV, and the decode-time variant of SnapKV, PyramidKV and
    /// AnDPro). `queries` are the post-RoPE queries of the last `window` positions,
    /// `[Hq][W][D]`; `headroom_tokens` dense tokens may be appended afterwards within the budget.
    pub fn compact<T: Element>(&mut self, queries: &[T], headroom_tokens: i64) -> Result<()> {
        self.require_host_memory()?;
        let window = usize::try_from(self.stats()?.window).unwrap_or(0);
        let expected = self.shape.num_q_heads * window * self.shape.head_dim;
        if queries.len() != expected {
            return Err(Error::invalid(format!("queries must hold Hq*W*D = {expected} elements; got {}", queries.len())));
        }
        // SAFETY: a host slice of the checked length.
        check(unsafe {
            sys::akv_cache_compact(self.as_raw(), queries.as_ptr().cast(), T::DTYPE as i32, headroom_tokens, ptr::null_mut())
        })
    }

    /// `decode` into a new vector.
    pub fn decode_to_vec<T: Element>(&self, queries: &[T]) -> Result<Vec<T>> {
        let mut out = vec![T::default(); queries.len()];
        self.decode(queries, &mut out)?;
        Ok(out)
    }

    /// `akv_decode` with raw pointers (device memory on CUDA).
    ///
    /// # Safety
    /// queries and out must hold `Hq*q_len*D` elements of `dtype` in the backend's memory
    /// space, valid until `stream` has finished the work.
    pub unsafe fn decode_raw(
        &self,
        queries: *const c_void,
        dtype: DType,
        q_len: i32,
        out: *mut c_void,
        stream: *mut c_void,
    ) -> Result<()> {
        check(sys::akv_decode(self.as_raw(), queries, dtype as i32, q_len, out, stream))
    }

    /// Dense K^ and V^ of every cached token; keys post-RoPE when `rotated`.
    pub fn reconstruct<T: Element>(&self, rotated: bool) -> Result<Reconstruction<T>> {
        self.require_host_memory()?;
        let tokens = self.num_tokens()?;
        let rows = self.shape.num_kv_heads * tokens;
        let mut keys = vec![T::default(); rows * self.shape.head_dim];
        let mut values = vec![T::default(); rows * self.shape.head_dim];
        let mut present = vec![0u8; rows];
        // SAFETY: outputs sized [H][T][D] and [H][T] for the current T.
        check(unsafe {
            sys::akv_cache_reconstruct(
                self.as_raw(),
                T::DTYPE as i32,
                rotated as i32,
                keys.as_mut_ptr().cast(),
                values.as_mut_ptr().cast(),
                present.as_mut_ptr(),
                ptr::null_mut(),
            )
        })?;
        Ok(Reconstruction { tokens, keys, values, present })
    }

    /// What `decode` subtracts from each token's logit per |s q|^2, `[H][T]` (s the softmax
    /// scale): with `reconstruct(true)`'s keys, decode is softmax(s q.k_t - penalty[h][t] |s q|^2)
    /// over the values. Non-zero only for the reconstructed prompt tokens of an AnchorKV cache
    /// in storage format 3 compressed with `logit_correction` > 0.
    pub fn logit_penalty(&self) -> Result<Vec<f32>> {
        let tokens = self.num_tokens()?;
        let mut out = vec![0f32; self.shape.num_kv_heads * tokens];
        // SAFETY: output sized [H][T] for the current T, host memory for every backend.
        check(unsafe { sys::akv_cache_logit_penalty(self.as_raw(), out.as_mut_ptr(), ptr::null_mut()) })?;
        Ok(out)
    }

    /// Bytes `serialize` will write.
    pub fn serialized_size(&self) -> Result<usize> {
        let mut bytes = 0usize;
        // SAFETY: valid cache and out pointer.
        check(unsafe { sys::akv_cache_serialized_size(self.as_raw(), &mut bytes) })?;
        Ok(bytes)
    }

    /// Write the versioned, checksummed bytes into `buffer`; returns the bytes written.
    /// (CPU caches: on CUDA the copy is asynchronous, see `serialize_raw`.)
    pub fn serialize_into(&self, buffer: &mut [u8]) -> Result<usize> {
        self.require_host_memory()?;
        // SAFETY: buffer valid for its length; a CPU call completes before returning.
        unsafe { self.serialize_raw(buffer.as_mut_ptr(), buffer.len(), ptr::null_mut()) }
    }

    /// `akv_cache_serialize` into host memory, on `stream` for a CUDA cache.
    ///
    /// # Safety
    /// `buffer` must be valid for `capacity` bytes until `stream` has finished the work.
    pub unsafe fn serialize_raw(&self, buffer: *mut u8, capacity: usize, stream: *mut c_void) -> Result<usize> {
        let mut written = 0usize;
        check(sys::akv_cache_serialize(self.as_raw(), buffer.cast(), capacity, &mut written, stream))?;
        Ok(written)
    }

    /// The versioned, checksummed, backend-independent bytes of this cache.
    pub fn serialize(&self) -> Result<Vec<u8>> {
        let mut buffer = vec![0u8; self.serialized_size()?];
        let written = self.serialize_into(&mut buffer)?;
        buffer.truncate(written);
        Ok(buffer)
    }
}
