//! Enumerations, shapes, options and statistics as Rust types.

use std::mem::MaybeUninit;

use anchorkv_sys as sys;

use crate::error::{check, Error, Result};

macro_rules! c_enum {
    ($(#[$meta:meta])* $name:ident { $($(#[$doc:meta])* $variant:ident = $value:path),+ $(,)? }) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(i32)]
        pub enum $name { $($(#[$doc])* $variant = $value),+ }

        impl $name {
            /// The variant of a C value, None for a value this binding does not know.
            pub fn from_raw(value: i32) -> Option<$name> {
                match value {
                    $(v if v == $value => Some($name::$variant),)+
                    _ => None,
                }
            }
        }
    };
}

c_enum!(
    /// Element type of tensors (`akv_dtype`). `Auto` only for storage.
    DType {
        /// Storage only: bf16, or f16 when the input is f16.
        Auto = sys::AKV_DTYPE_AUTO,
        /// IEEE binary32.
        F32 = sys::AKV_DTYPE_F32,
        /// IEEE binary16.
        F16 = sys::AKV_DTYPE_F16,
        /// bfloat16.
        Bf16 = sys::AKV_DTYPE_BF16,
    }
);
c_enum!(
    /// Where a context computes (`akv_backend`).
    Backend {
        /// The portable reference backend, host memory.
        Cpu = sys::AKV_BACKEND_CPU,
        /// NVIDIA GPUs, device memory (when the library was built with CUDA).
        Cuda = sys::AKV_BACKEND_CUDA,
    }
);
c_enum!(
    /// Compression method (`akv_method`).
    Method {
        /// Every token, exact: the reference.
        FullKv = sys::AKV_METHOD_FULLKV,
        /// Anchors, projection coefficients and 2-bit residuals: no token dropped.
        AnchorKv = sys::AKV_METHOD_ANCHORKV,
        /// Eviction: top pooled window attention per head.
        SnapKv = sys::AKV_METHOD_SNAPKV,
        /// Eviction: SnapKV scores, budgets decreasing over layers.
        PyramidKv = sys::AKV_METHOD_PYRAMIDKV,
        /// Eviction: SnapKV scores, budget shared across heads.
        AdaKv = sys::AKV_METHOD_ADAKV,
        /// Eviction: chunks scored by projection on the window output.
        AnDPro = sys::AKV_METHOD_ANDPRO,
        /// Every token, as b-bit codes (TurboQuant-style, about 4-6x).
        Quantized = sys::AKV_METHOD_QUANTIZED,
        /// Eviction: the last window query's attention over all heads (KVPress's TOVAPress; window 1).
        Tova = sys::AKV_METHOD_TOVA,
        /// Eviction: the smallest key norms (KVPress's KnormPress); no queries.
        Knorm = sys::AKV_METHOD_KNORM,
        /// Eviction: the sink tokens and the most recent ones (StreamingLLMPress); no queries.
        StreamingLlm = sys::AKV_METHOD_STREAMINGLLM,
    }
);
c_enum!(
    /// Rotary embedding layout (`akv_rope_style`).
    RopeStyle {
        /// No rotation (keys are stored as given).
        None = sys::AKV_ROPE_NONE,
        /// Rotate-half: pairs (i, i + rotary_dim/2), as Llama, Qwen, Mistral.
        NeoX = sys::AKV_ROPE_NEOX,
        /// Interleaved: pairs (2i, 2i + 1), as GPT-J.
        GptJ = sys::AKV_ROPE_GPTJ,
    }
);
c_enum!(
    /// Pooling of window-attention scores (`akv_pool_type`).
    PoolType {
        /// Average pooling.
        Avg = sys::AKV_POOL_AVG,
        /// Max pooling.
        Max = sys::AKV_POOL_MAX,
    }
);
c_enum!(
    /// Scaling of residuals before the 2-bit codebook (`akv_residual_scale`).
    ResidualScale {
        /// Codes from the RMS scale, then the scale refit by least squares.
        LeastSquares = sys::AKV_SCALE_LEAST_SQUARES,
        /// scale = ||y|| / sqrt(D) (unit-variance codebook).
        Rms = sys::AKV_SCALE_RMS,
        /// The outer level placed at the absmax, as the paper words it.
        Absmax = sys::AKV_SCALE_ABSMAX,
    }
);

/// Shape of one layer of one request: S prompt positions, H KV heads, Hq query heads
/// (a multiple of H), head dimension D.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Shape {
    /// S: prompt positions.
    pub seq_len: usize,
    /// H: KV heads.
    pub num_kv_heads: usize,
    /// Hq: query heads, a multiple of H (GQA).
    pub num_q_heads: usize,
    /// D: head dimension, even.
    pub head_dim: usize,
}

impl Shape {
    /// A shape from S, H, Hq and D, in that order.
    pub fn new(seq_len: usize, num_kv_heads: usize, num_q_heads: usize, head_dim: usize) -> Shape {
        Shape { seq_len, num_kv_heads, num_q_heads, head_dim }
    }

    /// Elements of keys or values: H*S*D.
    pub fn kv_len(&self) -> usize {
        self.num_kv_heads * self.seq_len * self.head_dim
    }

    pub(crate) fn to_raw(self) -> Result<sys::akv_shape> {
        let narrow = |value: usize, name: &str| {
            i32::try_from(value).map_err(|_| Error::invalid(format!("{name} {value} does not fit in int32")))
        };
        Ok(sys::akv_shape {
            seq_len: i64::try_from(self.seq_len).map_err(|_| Error::invalid("seq_len too large"))?,
            num_kv_heads: narrow(self.num_kv_heads, "num_kv_heads")?,
            num_q_heads: narrow(self.num_q_heads, "num_q_heads")?,
            head_dim: narrow(self.head_dim, "head_dim")?,
        })
    }

    pub(crate) fn from_raw(raw: &sys::akv_shape) -> Shape {
        Shape {
            seq_len: raw.seq_len.max(0) as usize,
            num_kv_heads: raw.num_kv_heads.max(0) as usize,
            num_q_heads: raw.num_q_heads.max(0) as usize,
            head_dim: raw.head_dim.max(0) as usize,
        }
    }
}

/// Options of a context (`akv_context_options` without the allocator hooks; use
/// `anchorkv-sys` directly for those).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ContextOptions {
    /// Where the context computes.
    pub backend: Backend,
    /// CUDA device ordinal.
    pub device: i32,
    /// CPU worker threads, at most 1024; 0 = all hardware threads (capped at 1024). A thread
    /// the system refuses gives `Status::OutOfMemory`. Decode outputs and AnchorKV's compressed
    /// caches are the same bytes with any count.
    pub num_threads: i32,
}

impl Default for ContextOptions {
    fn default() -> Self {
        ContextOptions { backend: Backend::Cpu, device: 0, num_threads: 0 }
    }
}

/// Compression options (`akv_compress_options`), starting from the library's defaults
/// (`akv_compress_options_init`: AnchorKV, retain_fraction 0.05, window 32, NeoX RoPE...).
/// Setters consume and return `self`, so options read as one expression.
#[derive(Debug, Clone)]
pub struct CompressOptions {
    raw: sys::akv_compress_options, // rope.inv_freq is always NULL here: see to_raw
    inv_freq: Option<Vec<f32>>,
}

// SAFETY: the only pointer in `raw` (rope.inv_freq) is kept NULL; the table lives in the Vec.
unsafe impl Send for CompressOptions {}
unsafe impl Sync for CompressOptions {}

impl Default for CompressOptions {
    fn default() -> Self {
        let mut raw = MaybeUninit::<sys::akv_compress_options>::zeroed();
        // SAFETY: init writes every field of the struct it is given.
        unsafe { sys::akv_compress_options_init(raw.as_mut_ptr()) };
        CompressOptions { raw: unsafe { raw.assume_init() }, inv_freq: None }
    }
}

impl CompressOptions {
    /// AnchorKV with the library's defaults (`akv_compress_options_init`).
    pub fn new() -> Self {
        Self::default()
    }

    /// The options `method` runs with in the paper (`akv_compress_options_init_method`):
    /// SnapKV/PyramidKV/AdaKV window 64 and pooling 5 (avg), AnDPro max pooling and chunks
    /// of 4, QUANTIZED 3 bits with 4 outlier channels and a 128-token window.
    pub fn for_method(method: Method) -> Self {
        let mut raw = MaybeUninit::<sys::akv_compress_options>::zeroed();
        // SAFETY: init_method writes every field of the struct it is given.
        unsafe { sys::akv_compress_options_init_method(raw.as_mut_ptr(), method as i32) };
        CompressOptions { raw: unsafe { raw.assume_init() }, inv_freq: None }
    }
    /// AnchorKV as its paper sets it up (`akv_compress_options_init_paper`): no sink anchors,
    /// k = max(W, S/128), no budget filling, rho 0.7 with a uniform sample for the rest,
    /// residual slots by the Eq. 6 utility alone.
    pub fn paper() -> Self {
        let mut raw = MaybeUninit::<sys::akv_compress_options>::zeroed();
        // SAFETY: init_paper writes every field of the struct it is given.
        unsafe { sys::akv_compress_options_init_paper(raw.as_mut_ptr()) };
        CompressOptions { raw: unsafe { raw.assume_init() }, inv_freq: None }
    }
    /// The method, keeping the other fields (see `for_method` for a method's own setup).
    pub fn method(mut self, method: Method) -> Self {
        self.raw.method = method as i32;
        self
    }
    /// AnchorKV: the first `tokens` prompt positions are always anchors (attention sinks).
    pub fn sink_tokens(mut self, tokens: i32) -> Self {
        self.raw.sink_tokens = tokens;
        self
    }
    /// AnchorKV with automatic anchors: the share of the budget left after the paper's base
    /// bytes that buys more anchors.
    pub fn anchor_share(mut self, share: f64) -> Self {
        self.raw.anchor_share = share;
        self
    }
    /// AnchorKV with automatic anchors: spend budget the residuals cannot use on more anchors.
    pub fn fill_budget(mut self, fill: bool) -> Self {
        self.raw.fill_budget = fill as i32;
        self
    }
    /// AnchorKV: share of the residual slots ranked by residual energy (query-agnostic).
    pub fn guard_fraction(mut self, share: f64) -> Self {
        self.raw.guard_fraction = share;
        self
    }
    /// AnchorKV: the anchors after the scored share are picked for coverage in `rounds`
    /// rounds, each from a pool that skips what an earlier pick would cover (0: a seeded
    /// uniform sample, as in the paper; default 8).
    pub fn coverage_rounds(mut self, rounds: i32) -> Self {
        self.raw.coverage_rounds = rounds;
        self
    }
    /// AnchorKV: the scored share holds at least `anchors` anchors (capped at k - W).
    pub fn scored_min(mut self, anchors: i32) -> Self {
        self.raw.scored_min = anchors;
        self
    }
    /// AnchorKV: a token's score is the largest of its own and the `tokens` before it, so the
    /// text after what the window attends to is scored with it (0: the paper's score).
    pub fn follow_tokens(mut self, tokens: i32) -> Self {
        self.raw.follow_tokens = tokens;
        self
    }
    /// AnchorKV (storage format 3): the decode lowers each reconstructed token's logit by
    /// `c` |q|^2 times its head's mean squared key error per dimension, which removes the
    /// attention key errors add to those tokens on average (0: attention over the
    /// reconstruction as it is; default 0.5).
    pub fn logit_correction(mut self, c: f64) -> Self {
        self.raw.logit_correction = c;
        self
    }
    /// theta in (0, 1]: the footprint stays at most theta * 4*S*H*D bytes. FullKV, the exact
    /// reference, keeps every token and ignores it (`budget_bytes` = `full_bytes`).
    pub fn retain_fraction(mut self, theta: f64) -> Self {
        self.raw.retain_fraction = theta;
        self
    }
    /// W: recent positions kept exactly; the prefill's queries hold W positions.
    pub fn window(mut self, window: i32) -> Self {
        self.raw.window = window;
        self
    }
    /// AnchorKV: storage layout, 3 (local anchor tables, one-byte indices and coefficients,
    /// implicit positions) or 2 (the paper's); 0 = 3.
    pub fn storage_format(mut self, format: i32) -> Self {
        self.raw.storage_format = format;
        self
    }
    /// AnchorKV: k anchors per head including the window; 0 = automatic.
    pub fn anchors(mut self, anchors: i32) -> Self {
        self.raw.anchors = anchors;
        self
    }
    /// AnchorKV: rho, the share of the k-W free anchors chosen by window-attention score.
    pub fn scored_fraction(mut self, rho: f64) -> Self {
        self.raw.scored_fraction = rho;
        self
    }
    /// Pooling of the window-attention scores: odd kernel width and type.
    pub fn pool(mut self, kernel: i32, pool_type: PoolType) -> Self {
        self.raw.pool_kernel = kernel;
        self.raw.pool_type = pool_type as i32;
        self
    }
    /// AnchorKV: how residuals are scaled before the 2-bit codebook.
    pub fn residual_scale(mut self, scale: ResidualScale) -> Self {
        self.raw.residual_scale = scale as i32;
        self
    }
    /// Seed of the anchor sampling and the Hadamard signs.
    pub fn seed(mut self, seed: u64) -> Self {
        self.raw.seed = seed;
        self
    }
    /// This layer's index among `count`: keys the sampler, and sets PyramidKV's budget.
    pub fn layer(mut self, index: i32, count: i32) -> Self {
        self.raw.layer_index = index;
        self.raw.layer_count = count;
        self
    }
    /// RoPE of the model: style, rotated dims (0 = head_dim), base theta.
    pub fn rope(mut self, style: RopeStyle, rotary_dim: i32, base: f64) -> Self {
        self.raw.rope.style = style as i32;
        self.raw.rope.rotary_dim = rotary_dim;
        self.raw.rope.base = base;
        self
    }
    /// Explicit inverse frequencies (rotary_dim/2 of them, rotary_dim 0 meaning head_dim),
    /// overriding the base. The length is checked when the options are used: a table of
    /// another length fails with `Status::InvalidArgument` (the C struct has no length).
    pub fn inv_freq(mut self, inv_freq: Vec<f32>) -> Self {
        self.inv_freq = Some(inv_freq);
        self
    }
    /// The keys given carry RoPE already (the library de-rotates them); default: pre-RoPE.
    pub fn keys_post_rope(mut self, post_rope: bool) -> Self {
        self.raw.keys_post_rope = post_rope as i32;
        self
    }
    /// 0 = 1/sqrt(head_dim).
    pub fn softmax_scale(mut self, scale: f32) -> Self {
        self.raw.softmax_scale = scale;
        self
    }
    /// Element type of the exact tokens kept: `Auto`, `F16` or `Bf16`.
    pub fn storage_dtype(mut self, dtype: DType) -> Self {
        self.raw.storage_dtype = dtype as i32;
        self
    }
    /// AdaKV: share of the per-head budget every head keeps, in [0, 1].
    pub fn adakv_alpha(mut self, alpha: f64) -> Self {
        self.raw.adakv_alpha = alpha;
        self
    }
    /// QUANTIZED: bits per coordinate (2, 3, 4; 0 = the most that fit) and exact outlier
    /// channels per key.
    pub fn quantization(mut self, bits: i32, outliers: i32) -> Self {
        self.raw.quant_bits = bits;
        self.raw.quant_outliers = outliers;
        self
    }
    /// PyramidKV: the last layer keeps (B-W)/beta evictable tokens per head.
    pub fn pyramid_beta(mut self, beta: i32) -> Self {
        self.raw.pyramid_beta = beta;
        self
    }
    /// AnDPro: tokens per scored chunk.
    pub fn andpro_chunk(mut self, chunk: i32) -> Self {
        self.raw.andpro_chunk = chunk;
        self
    }

    /// W as set: how many positions the prefill's queries must hold.
    pub fn get_window(&self) -> i32 {
        self.raw.window
    }

    /// The C struct as set (inv_freq not yet pointed at the table).
    pub fn raw(&self) -> &sys::akv_compress_options {
        &self.raw
    }

    /// The C struct, pointing into `self` for the inverse-frequency table. The table's
    /// length is not checked here (the library reads rotary_dim/2 floats from it): callers
    /// of the raw API check it, as `to_raw_for` does.
    pub fn to_raw(&self) -> sys::akv_compress_options {
        let mut raw = self.raw;
        raw.rope.inv_freq = self.inv_freq.as_ref().map_or(std::ptr::null(), |table| table.as_ptr());
        raw
    }

    /// `to_raw` for a layer of `head_dim`, after checking that the inverse-frequency table
    /// holds the rotary_dim/2 entries the library will read.
    pub fn to_raw_for(&self, head_dim: i32) -> Result<sys::akv_compress_options> {
        if let Some(table) = &self.inv_freq {
            let rope = &self.raw.rope;
            let rotary_dim = if rope.rotary_dim == 0 { head_dim } else { rope.rotary_dim };
            // Without a rotation the table is not read; a negative or odd rotary_dim is
            // refused by the library before it reads the table.
            if rope.style != sys::AKV_ROPE_NONE && rotary_dim > 0 && table.len() != (rotary_dim / 2) as usize {
                return Err(Error::invalid(format!(
                    "inv_freq holds {} frequencies; rotary_dim {rotary_dim} needs {}",
                    table.len(),
                    rotary_dim / 2
                )));
            }
        }
        Ok(self.to_raw())
    }
}

/// Exact bytes a compressed cache of this shape will hold, before any data is seen.
pub fn compressed_size(options: &CompressOptions, shape: Shape) -> Result<usize> {
    let raw_shape = shape.to_raw()?;
    let raw_options = options.to_raw_for(raw_shape.head_dim)?;
    let mut bytes = 0usize;
    // SAFETY: both structs are valid for the call; inv_freq points into `options`.
    check(unsafe { sys::akv_compressed_size(&raw_options, &raw_shape, &mut bytes) })?;
    Ok(bytes)
}

/// Byte accounting and counts of one cache (`akv_cache_stats`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CacheStats {
    /// The method (None for a method this binding does not know).
    pub method: Option<Method>,
    /// The shape of the prompt.
    pub shape: Shape,
    /// Element type of the exact tokens kept.
    pub storage_dtype: Option<DType>,
    /// W: recent positions kept exactly (0 for FullKV).
    pub window: i32,
    /// k anchors per head (AnchorKV).
    pub anchors: i32,
    /// Tokens appended since compression.
    pub appended_tokens: i64,
    /// Tokens that can be appended without allocating.
    pub append_capacity: i64,
    /// M_full = 4*S*H*D.
    pub full_bytes: u64,
    /// floor(theta * M_full); FullKV: M_full (theta ignored).
    pub budget_bytes: u64,
    /// M_base (AnchorKV): anchors and per-token metadata.
    pub base_bytes: u64,
    /// Footprint of the compressed prompt, equal to `compressed_size`.
    pub compressed_bytes: u64,
    /// Dense suffix in use: 4*appended*H*D.
    pub appended_bytes: u64,
    /// Bytes this cache holds through the allocator.
    pub allocated_bytes: u64,
    /// full_bytes / compressed_bytes.
    pub ratio: f64,
    /// Residuals stored on the key side, all heads.
    pub key_residuals: i64,
    /// Residuals stored on the value side, all heads.
    pub value_residuals: i64,
    /// AnchorKV: storage format, 2 or 3; 0 for the other methods.
    pub storage_format: i32,
}

impl CacheStats {
    pub(crate) fn from_raw(raw: &sys::akv_cache_stats) -> CacheStats {
        CacheStats {
            method: Method::from_raw(raw.method),
            shape: Shape::from_raw(&raw.shape),
            storage_dtype: DType::from_raw(raw.storage_dtype),
            window: raw.window,
            anchors: raw.anchors,
            appended_tokens: raw.appended_tokens,
            append_capacity: raw.append_capacity,
            full_bytes: raw.full_bytes,
            budget_bytes: raw.budget_bytes,
            base_bytes: raw.base_bytes,
            compressed_bytes: raw.compressed_bytes,
            appended_bytes: raw.appended_bytes,
            allocated_bytes: raw.allocated_bytes,
            ratio: raw.ratio,
            key_residuals: raw.key_residuals,
            value_residuals: raw.value_residuals,
            storage_format: raw.storage_format,
        }
    }
}

/// What one KV head keeps (`akv_head_stats`).
pub type HeadStats = sys::akv_head_stats;
