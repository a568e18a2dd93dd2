//! `Context`: a backend, its threads and allocator. Caches hold it through an `Arc`.

use std::cell::Cell;
use std::ffi::c_void;
use std::fmt;
use std::marker::PhantomData;
use std::mem::MaybeUninit;
use std::ptr::{self, NonNull};
use std::sync::{Arc, OnceLock};

use anchorkv_sys as sys;

use crate::cache::Cache;
use crate::element::Element;
use crate::error::{check, Error, Result, Status};
use crate::options::{Backend, CompressOptions, ContextOptions, Shape};

/// The C context. Destroyed when the last owner (the Context or one of its caches) drops,
/// so it always outlives its caches, as akv_context_destroy requires.
pub(crate) struct ContextHandle {
    pub(crate) raw: NonNull<sys::akv_context>,
}

// SAFETY: the header makes the context read-only for cache calls ("akv_context is used
// read-only by cache calls, except that a CPU context's thread pool serialises calls"), and
// the one mutating call, destroy, runs in Drop when no other owner is left.
unsafe impl Send for ContextHandle {}
unsafe impl Sync for ContextHandle {}

impl Drop for ContextHandle {
    fn drop(&mut self) {
        // SAFETY: created by akv_context_create; every cache holding this handle is gone.
        unsafe { sys::akv_context_destroy(self.raw.as_ptr()) }
    }
}

/// An anchorkv context (`akv_context`).
///
/// `Send` (move it to another thread) but not `Sync`: one handle is used by one thread at a
/// time, as the C API requires. Caches keep the C context alive through an `Arc`, so a
/// `Cache` may outlive the `Context` value it came from.
///
/// ```compile_fail
/// fn shared<T: Sync>(_: &T) {}
/// let context = anchorkv::Context::cpu().unwrap();
/// shared(&context); // Context is not Sync
/// ```
pub struct Context {
    pub(crate) handle: Arc<ContextHandle>,
    backend: Backend,
    device: i32,
    _not_sync: PhantomData<Cell<()>>,
}

impl fmt::Debug for Context {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Context")
            .field("backend", &self.backend)
            .field("device", &self.device)
            .field("raw", &self.handle.raw)
            .finish()
    }
}

/// Checks once per process that the linked library is this binding's major version and at
/// least the version the binding was written for.
fn check_library_version() -> Result<()> {
    static CHECKED: OnceLock<Result<()>> = OnceLock::new();
    CHECKED
        .get_or_init(|| {
            let loaded = crate::version_number();
            if loaded / 10000 == sys::AKV_VERSION_MAJOR && loaded >= sys::AKV_VERSION_NUMBER {
                Ok(())
            } else {
                Err(Error::new(
                    Status::Version,
                    format!(
                        "libanchorkv {} is loaded; this binding needs {}.x at least {}",
                        crate::version(),
                        sys::AKV_VERSION_MAJOR,
                        sys::AKV_VERSION_STRING
                    ),
                ))
            }
        })
        .clone()
}

impl Context {
    /// A context with these options (`akv_context_create`); checks the library's version.
    pub fn new(options: &ContextOptions) -> Result<Context> {
        check_library_version()?;
        let mut raw_options = MaybeUninit::<sys::akv_context_options>::zeroed();
        // SAFETY: init fills the struct; then we set plain fields.
        let mut raw_options = unsafe {
            sys::akv_context_options_init(raw_options.as_mut_ptr());
            raw_options.assume_init()
        };
        raw_options.backend = options.backend as i32;
        raw_options.device = options.device;
        raw_options.num_threads = options.num_threads;
        let mut raw = ptr::null_mut();
        // SAFETY: valid options and out pointer.
        check(unsafe { sys::akv_context_create(&raw_options, &mut raw) })?;
        let raw = NonNull::new(raw).ok_or_else(|| Error::new(Status::Internal, "akv_context_create returned NULL"))?;
        Ok(Context {
            handle: Arc::new(ContextHandle { raw }),
            backend: options.backend,
            device: options.device,
            _not_sync: PhantomData,
        })
    }

    /// A CPU context using every hardware thread.
    pub fn cpu() -> Result<Context> {
        Context::new(&ContextOptions::default())
    }

    /// Where this context computes.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The CUDA device ordinal (0 on the CPU).
    pub fn device(&self) -> i32 {
        self.device
    }

    /// The C handle, for calls through `anchorkv-sys`. Stays owned by this Context.
    pub fn as_raw(&self) -> *mut sys::akv_context {
        self.handle.raw.as_ptr()
    }

    pub(crate) fn require_host_memory(&self) -> Result<()> {
        if self.backend == Backend::Cpu {
            Ok(())
        } else {
            Err(Error::new(
                Status::Mismatch,
                "host slices were given to a CUDA context; use the unsafe *_raw calls with device pointers",
            ))
        }
    }

    /// Compress one layer from host slices (CPU context).
    pub fn compress<T: Element>(&self, prefill: &Prefill<'_, T>, options: &CompressOptions) -> Result<Cache> {
        self.require_host_memory()?;
        let shape = prefill.shape;
        let raw_shape = shape.to_raw()?;
        let d = shape.head_dim;
        let window = usize::try_from(options.get_window()).unwrap_or(0);
        let kv_strides = prefill.kv_strides.unwrap_or(Strides { head: shape.seq_len * d, token: d });
        let query_strides = prefill.query_strides.unwrap_or(Strides { head: window * d, token: d });
        for (strides, name) in [(prefill.kv_strides, "kv_strides"), (prefill.query_strides, "query_strides")] {
            let Some(strides) = strides else { continue }; // the defaults follow the shape
            if strides.token < d || strides.head == 0 {
                return Err(Error::invalid(format!(
                    "{name}: the token stride must be at least D = {d} and the head stride positive; got {strides:?}"
                )));
            }
        }
        // Contiguous slices must match the shape exactly; strided ones must cover every
        // element the library reads.
        let covers = |len: usize, span: usize, strided: bool| if strided { len >= span } else { len == span };
        let kv_span = kv_strides.span(shape.num_kv_heads, shape.seq_len, d);
        let strided = prefill.kv_strides.is_some();
        if !covers(prefill.keys.len(), kv_span, strided) || !covers(prefill.values.len(), kv_span, strided) {
            return Err(Error::invalid(format!(
                "keys and values must hold {}{kv_span} elements (H*S*D with {kv_strides:?}); got {} and {}",
                if strided { "at least " } else { "" },
                prefill.keys.len(),
                prefill.values.len()
            )));
        }
        if let Some(queries) = prefill.queries {
            let span = query_strides.span(shape.num_q_heads, window, d);
            if !covers(queries.len(), span, prefill.query_strides.is_some()) {
                return Err(Error::invalid(format!(
                    "queries must hold {span} elements (Hq*W*D, W = options window {window}, {query_strides:?}); got {}",
                    queries.len()
                )));
            }
        }
        if let Some(positions) = prefill.positions {
            if positions.len() != shape.seq_len {
                return Err(Error::invalid(format!(
                    "positions must hold S = {} entries; got {}",
                    shape.seq_len,
                    positions.len()
                )));
            }
        }
        let mut raw = unsafe {
            let mut raw = MaybeUninit::<sys::akv_prefill>::zeroed();
            sys::akv_prefill_init(raw.as_mut_ptr());
            raw.assume_init()
        };
        raw.shape = raw_shape;
        raw.dtype = T::DTYPE as i32;
        raw.keys = prefill.keys.as_ptr().cast();
        raw.values = prefill.values.as_ptr().cast();
        raw.queries = prefill.queries.map_or(ptr::null(), |queries| queries.as_ptr().cast());
        raw.positions = prefill.positions.map_or(ptr::null(), |positions| positions.as_ptr());
        (raw.kv_head_stride, raw.kv_token_stride) = kv_strides.to_raw("kv_strides")?;
        (raw.q_head_stride, raw.q_token_stride) = query_strides.to_raw("query_strides")?;
        // SAFETY: host slices that cover every element the shape and strides reach, read
        // during the call only.
        unsafe { self.compress_raw(&raw, options, ptr::null_mut()) }
    }

    /// Compress from a raw `akv_prefill` (device pointers on a CUDA context, strides).
    ///
    /// # Safety
    /// The pointers in `prefill` must be valid for the shape, strides and dtype it states, in
    /// the memory space of this context's backend, until `stream` has finished the work.
    pub unsafe fn compress_raw(
        &self,
        prefill: &sys::akv_prefill,
        options: &CompressOptions,
        stream: *mut c_void,
    ) -> Result<Cache> {
        let raw_options = options.to_raw_for(prefill.shape.head_dim)?;
        let mut raw_cache = ptr::null_mut();
        check(sys::akv_compress(self.as_raw(), prefill, &raw_options, &mut raw_cache, stream))?;
        Cache::adopt(self, raw_cache)
    }

    /// A cache from `Cache::serialize` bytes (CPU context; see `deserialize_raw`).
    pub fn deserialize(&self, bytes: &[u8]) -> Result<Cache> {
        self.require_host_memory()?;
        // SAFETY: the slice is valid for its length; a CPU call completes before returning.
        unsafe { self.deserialize_raw(bytes.as_ptr(), bytes.len(), ptr::null_mut()) }
    }

    /// `akv_cache_deserialize` from host bytes, on `stream` for a CUDA context.
    ///
    /// # Safety
    /// `bytes` must be valid for `size` bytes until `stream` has finished the work.
    pub unsafe fn deserialize_raw(&self, bytes: *const u8, size: usize, stream: *mut c_void) -> Result<Cache> {
        let mut raw_cache = ptr::null_mut();
        check(sys::akv_cache_deserialize(self.as_raw(), bytes.cast(), size, &mut raw_cache, stream))?;
        Cache::adopt(self, raw_cache)
    }

    /// Decode many caches of this context in one call: queries and out are
    /// `[batch][Hq][q_len][D]`.
    pub fn decode_batch<T: Element>(&self, caches: &[&Cache], queries: &[T], out: &mut [T]) -> Result<()> {
        self.require_host_memory()?;
        let first = caches.first().ok_or_else(|| Error::invalid("decode_batch needs at least one cache"))?;
        let shape = first.shape();
        let per_token = caches.len() * shape.num_q_heads * shape.head_dim;
        if per_token == 0 || queries.len() % per_token != 0 || queries.len() == 0 || out.len() != queries.len() {
            return Err(Error::invalid(format!(
                "queries and out must hold batch*Hq*q_len*D elements (a multiple of {per_token}); got {} and {}",
                queries.len(),
                out.len()
            )));
        }
        for cache in caches {
            let other = cache.shape();
            if (other.num_kv_heads, other.num_q_heads, other.head_dim)
                != (shape.num_kv_heads, shape.num_q_heads, shape.head_dim)
            {
                // The library checks this too; the slice lengths above assume it.
                return Err(Error::new(Status::Mismatch, "caches of one batch must share H, Hq and D"));
            }
        }
        let q_len = i32::try_from(queries.len() / per_token).map_err(|_| Error::invalid("q_len too large"))?;
        let batch = i32::try_from(caches.len()).map_err(|_| Error::invalid("batch too large"))?;
        let raw_caches: Vec<*mut sys::akv_cache> = caches.iter().map(|cache| cache.as_raw()).collect();
        // SAFETY: host slices of checked lengths; the caches are borrowed for the call.
        check(unsafe {
            sys::akv_decode_batch(
                self.as_raw(),
                raw_caches.as_ptr(),
                batch,
                queries.as_ptr().cast(),
                T::DTYPE as i32,
                q_len,
                out.as_mut_ptr().cast(),
                ptr::null_mut(),
            )
        })
    }
}

/// Distances in elements between consecutive heads and consecutive tokens of a
/// `[heads][tokens][D]` tensor whose last dimension is contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Strides {
    /// Elements from one head to the next.
    pub head: usize,
    /// Elements from one token to the next, at least D.
    pub token: usize,
}

impl Strides {
    /// Elements a tensor of these strides spans: the highest index read, plus one.
    fn span(self, heads: usize, tokens: usize, head_dim: usize) -> usize {
        if heads == 0 || tokens == 0 {
            return 0;
        }
        (heads - 1) * self.head + (tokens - 1) * self.token + head_dim
    }

    fn to_raw(self, name: &str) -> Result<(i64, i64)> {
        let narrow = |value: usize| i64::try_from(value).map_err(|_| Error::invalid(format!("{name} too large")));
        Ok((narrow(self.head)?, narrow(self.token)?))
    }
}

/// The host tensors of one layer at the end of prefill: keys and values `[H][S][D]`, window
/// queries `[Hq][W][D]` (post-RoPE), positions `[S]`.
///
/// Head-major and contiguous by default; `kv_strides` and `query_strides` describe other
/// layouts without a copy, e.g. an engine's token-major `[S][H][D]` keys and values:
///
/// ```no_run
/// # use anchorkv::{Prefill, Shape};
/// let shape = Shape::new(512, 2, 4, 64); // S, H, Hq, D
/// let (keys, values) = (vec![0f32; 512 * 2 * 64], vec![0f32; 512 * 2 * 64]); // [S][H][D]
/// let prefill = Prefill::new(shape, &keys, &values).kv_strides(64, 2 * 64); // head D, token H*D
/// ```
#[derive(Debug, Clone, Copy)]
pub struct Prefill<'a, T: Element> {
    /// S, H, Hq and D.
    pub shape: Shape,
    /// Keys, pre-RoPE unless the options say `keys_post_rope`.
    pub keys: &'a [T],
    /// Values, with the keys' strides.
    pub values: &'a [T],
    /// Post-RoPE queries of the last W positions.
    pub queries: Option<&'a [T]>,
    /// Token positions, strictly increasing (None: 0..S-1).
    pub positions: Option<&'a [i32]>,
    /// Strides of keys and values (None: contiguous `[H][S][D]`).
    pub kv_strides: Option<Strides>,
    /// Strides of the queries (None: contiguous `[Hq][W][D]`).
    pub query_strides: Option<Strides>,
}

impl<'a, T: Element> Prefill<'a, T> {
    /// Contiguous head-major keys and values, no queries, default positions.
    pub fn new(shape: Shape, keys: &'a [T], values: &'a [T]) -> Self {
        Prefill { shape, keys, values, queries: None, positions: None, kv_strides: None, query_strides: None }
    }

    /// Keys and values laid out with these strides in elements (both share them): `head`
    /// between heads, `token` (at least D) between tokens. The slices must span
    /// `(H-1)*head + (S-1)*token + D` elements.
    pub fn kv_strides(mut self, head: usize, token: usize) -> Self {
        self.kv_strides = Some(Strides { head, token });
        self
    }

    /// Queries laid out with these strides in elements; the slice must span
    /// `(Hq-1)*head + (W-1)*token + D` elements.
    pub fn query_strides(mut self, head: usize, token: usize) -> Self {
        self.query_strides = Some(Strides { head, token });
        self
    }

    /// Post-RoPE queries of the last W prompt positions (needed by every method but FullKV).
    pub fn queries(mut self, queries: &'a [T]) -> Self {
        self.queries = Some(queries);
        self
    }

    /// Token positions, strictly increasing (default 0..S-1).
    pub fn positions(mut self, positions: &'a [i32]) -> Self {
        self.positions = Some(positions);
        self
    }
}
