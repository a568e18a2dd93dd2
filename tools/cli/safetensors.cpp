#include "safetensors.hpp"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <sstream>
#include <sys/types.h>

#include "common.hpp"

namespace akvcli {

const char *const kDataFormatHelp = R"(Data file (--data FILE.safetensors; see tools/cli/README-data.md):
  safetensors layout: 8-byte little-endian header length N, N bytes of JSON header, raw data.
  Tensors (F32, F16 or BF16, row-major):
    k         [L, H, S, D]   keys of the prompt (pre-RoPE unless keys_post_rope=1)
    v         [L, H, S, D]   values
    q_window  [L, Hq, W, D]  post-RoPE queries of the last W prompt positions
    q_future  [L, Hq, F, D]  post-RoPE held-out queries (later positions, never in the window)
    inv_freq  [rotary_dim/2] optional F32 RoPE frequency table (Llama-3 / YaRN scaling)
  __metadata__ (all values are strings):
    rope_style      neox | gptj | none             (required)
    rope_base       e.g. "10000", "500000"          (default 10000)
    rotary_dim      rotated dims, "0" = D           (default D)
    keys_post_rope  "0" | "1"                       (default 0)
    position_offset position of prompt token 0      (default 0)
    softmax_scale   attention scale                 (default 1/sqrt(D))
  Library inputs keep the file's dtype (override with --dtype). Needles are planted into
  the loaded K/V in memory (the file is not changed); --needles 0 disables them.
  tools/cli/scripts/make_eval_data.py writes such a file from numpy.
)";

namespace {

struct DtypeEntry {
  const char *name;
  size_t bytes;
};
// Every dtype the safetensors format defines, so headers of files holding other tensors parse.
constexpr DtypeEntry kDtypes[] = {{"BOOL", 1}, {"U8", 1},   {"I8", 1},   {"F8_E5M2", 1},
                                  {"F8_E4M3", 1}, {"I16", 2}, {"U16", 2}, {"F16", 2},
                                  {"BF16", 2}, {"I32", 4},   {"U32", 4},  {"F32", 4},
                                  {"F64", 8},  {"I64", 8},   {"U64", 8}};
constexpr uint64_t kMaxHeaderBytes = 100u * 1000u * 1000u;  // the format's own limit

uint64_t read_le64(const unsigned char *bytes) {
  uint64_t value = 0;
  for (int i = 7; i >= 0; --i) value = (value << 8) | bytes[i];
  return value;
}

int64_t parse_integer(const std::string &text, const std::string &what) {
  size_t used = 0;
  long long value = 0;
  try {
    value = std::stoll(text, &used, 10);
  } catch (const std::exception &) {
    used = 0;
  }
  if (used == 0 || used != text.size())
    throw CliError(what + " must be an integer, got \"" + text + "\"");
  return value;
}

double parse_number(const std::string &text, const std::string &what) {
  size_t used = 0;
  double value = 0;
  try {
    value = std::stod(text, &used);
  } catch (const std::exception &) {
    used = 0;
  }
  if (used == 0 || used != text.size() || !std::isfinite(value))
    throw CliError(what + " must be a finite number, got \"" + text + "\"");
  return value;
}

std::string shape_text(const std::vector<int64_t> &shape) {
  std::ostringstream text;
  text << "[";
  for (size_t i = 0; i < shape.size(); ++i) text << (i ? ", " : "") << shape[i];
  text << "]";
  return text.str();
}

}  // namespace

int64_t TensorInfo::elements() const {
  int64_t count = 1;
  for (int64_t dim : shape) count *= dim;
  return count;
}

SafetensorsFile::SafetensorsFile(const std::string &path) : path_(path) {
  auto fail = [&](const std::string &why) -> CliError {
    return CliError(path_ + ": not a valid safetensors file: " + why);
  };
  file_.reset(std::fopen(path.c_str(), "rb"));
  if (!file_) throw CliError(path_ + ": cannot open: " + std::strerror(errno));
  if (fseeko(file_.get(), 0, SEEK_END) != 0) throw CliError(path_ + ": cannot seek");
  const uint64_t file_size = static_cast<uint64_t>(ftello(file_.get()));
  std::rewind(file_.get());

  unsigned char prefix[8];
  if (file_size < 8 || std::fread(prefix, 1, 8, file_.get()) != 8)
    throw fail("shorter than the 8-byte header length (" + std::to_string(file_size) + " bytes)");
  const uint64_t header_bytes = read_le64(prefix);
  if (header_bytes < 2 || header_bytes > kMaxHeaderBytes || header_bytes > file_size - 8)
    throw fail("header length " + std::to_string(header_bytes) + " does not fit the file (" +
               std::to_string(file_size) + " bytes)");
  std::string header(header_bytes, '\0');
  if (std::fread(&header[0], 1, header_bytes, file_.get()) != header_bytes)
    throw fail("truncated header");
  data_start_ = 8 + header_bytes;
  data_size_ = file_size - data_start_;

  nlohmann::json json;
  try {
    json = nlohmann::json::parse(header);
  } catch (const nlohmann::json::exception &error) {
    throw fail(std::string("header is not valid JSON: ") + error.what());
  }
  if (!json.is_object()) throw fail("header is not a JSON object");

  for (auto item = json.begin(); item != json.end(); ++item) {
    const std::string &name = item.key();
    const nlohmann::json &entry = item.value();
    if (name == "__metadata__") {
      if (!entry.is_object()) throw fail("__metadata__ is not an object");
      for (auto field = entry.begin(); field != entry.end(); ++field) {
        if (!field.value().is_string())
          throw fail("__metadata__." + field.key() + " is not a string (safetensors metadata "
                     "values are strings)");
        metadata_[field.key()] = field.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor \"" + name + "\": ";
    if (!entry.is_object()) throw fail(where + "entry is not an object");
    if (!entry.contains("dtype") || !entry["dtype"].is_string())
      throw fail(where + "missing string field dtype");
    if (!entry.contains("shape") || !entry["shape"].is_array())
      throw fail(where + "missing array field shape");
    if (!entry.contains("data_offsets") || !entry["data_offsets"].is_array() ||
        entry["data_offsets"].size() != 2)
      throw fail(where + "data_offsets must be [begin, end]");
    TensorInfo info;
    info.name = name;
    info.dtype_name = entry["dtype"].get<std::string>();
    for (const DtypeEntry &known : kDtypes)
      if (info.dtype_name == known.name) info.item_bytes = known.bytes;
    if (info.item_bytes == 0) throw fail(where + "unknown dtype \"" + info.dtype_name + "\"");
    if (info.dtype_name == "F32" || info.dtype_name == "F16" || info.dtype_name == "BF16") {
      info.float_dtype = true;
      info.dtype = info.dtype_name == "F32"   ? TensorDtype::F32
                   : info.dtype_name == "F16" ? TensorDtype::F16
                                              : TensorDtype::BF16;
    }
    uint64_t elements = 1;
    for (const auto &dim : entry["shape"]) {
      if (!dim.is_number_integer() || dim.get<int64_t>() < 0)
        throw fail(where + "shape entries must be non-negative integers");
      const uint64_t size = dim.get<uint64_t>();
      if (size != 0 && elements > (uint64_t{1} << 62) / size) throw fail(where + "shape too large");
      elements *= size;
      info.shape.push_back(static_cast<int64_t>(size));
    }
    for (const auto &offset : entry["data_offsets"])
      if (!offset.is_number_integer() || offset.get<int64_t>() < 0)
        throw fail(where + "data_offsets must be non-negative integers");
    info.begin = entry["data_offsets"][0].get<uint64_t>();
    info.end = entry["data_offsets"][1].get<uint64_t>();
    if (info.begin > info.end || info.end > data_size_)
      throw fail(where + "data_offsets [" + std::to_string(info.begin) + ", " +
                 std::to_string(info.end) + "] outside the data section of " +
                 std::to_string(data_size_) + " bytes (file truncated?)");
    if (info.end - info.begin != elements * info.item_bytes)
      throw fail(where + "data_offsets span " + std::to_string(info.end - info.begin) +
                 " bytes but shape " + shape_text(info.shape) + " of " + info.dtype_name +
                 " needs " + std::to_string(elements * info.item_bytes));
    tensors_[name] = info;
  }
}

const TensorInfo *SafetensorsFile::find(const std::string &name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

std::vector<float> SafetensorsFile::read(const TensorInfo &tensor, int64_t first,
                                         int64_t count) const {
  if (!tensor.float_dtype)
    throw CliError(path_ + ": tensor \"" + tensor.name + "\" has dtype " + tensor.dtype_name +
                   "; F32, F16 or BF16 expected");
  if (first < 0 || count < 0 || first + count > tensor.elements())
    throw CliError(path_ + ": read outside tensor \"" + tensor.name + "\"");
  const uint64_t offset = data_start_ + tensor.begin + static_cast<uint64_t>(first) * tensor.item_bytes;
  const size_t bytes = static_cast<size_t>(count) * tensor.item_bytes;
  std::vector<unsigned char> raw(bytes);
  if (fseeko(file_.get(), static_cast<off_t>(offset), SEEK_SET) != 0 ||
      std::fread(raw.data(), 1, bytes, file_.get()) != bytes)
    throw CliError(path_ + ": cannot read tensor \"" + tensor.name + "\" (file truncated?)");
  std::vector<float> out(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i) {
    const unsigned char *p = raw.data() + i * tensor.item_bytes;
    switch (tensor.dtype) {
      case TensorDtype::F32: {
        const uint32_t bits = static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[1]) << 8) |
                              (static_cast<uint32_t>(p[2]) << 16) | (static_cast<uint32_t>(p[3]) << 24);
        std::memcpy(&out[i], &bits, 4);
        break;
      }
      case TensorDtype::F16:
        out[i] = f16_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8)));
        break;
      case TensorDtype::BF16:
        out[i] = bf16_to_float(static_cast<uint16_t>(p[0] | (p[1] << 8)));
        break;
    }
    if (!std::isfinite(out[i]))
      throw CliError(path_ + ": tensor \"" + tensor.name + "\" holds a NaN or Inf at element " +
                     std::to_string(first + i));
  }
  return out;
}

// ---- the eval data source ----------------------------------------------------------------

SafetensorsSource::SafetensorsSource(const std::string &path, akv_dtype dtype_override)
    : file_(path) {
  auto fail = [&](const std::string &why) -> CliError { return CliError(path + ": " + why); };
  auto require = [&](const char *name) -> const TensorInfo * {
    const TensorInfo *tensor = file_.find(name);
    if (tensor == nullptr) throw fail(std::string("missing tensor \"") + name + "\"");
    if (!tensor->float_dtype)
      throw fail(std::string("tensor \"") + name + "\" has dtype " + tensor->dtype_name +
                 "; F32, F16 or BF16 expected");
    if (tensor->shape.size() != 4)
      throw fail(std::string("tensor \"") + name + "\" has shape " + shape_text(tensor->shape) +
                 "; 4 dimensions expected");
    for (int64_t dim : tensor->shape)
      if (dim <= 0) throw fail(std::string("tensor \"") + name + "\" has an empty dimension");
    return tensor;
  };
  k_ = require("k");
  v_ = require("v");
  q_window_ = require("q_window");
  q_future_ = require("q_future");
  if (k_->shape != v_->shape)
    throw fail("k " + shape_text(k_->shape) + " and v " + shape_text(v_->shape) + " differ");
  shape_.layers = static_cast<int>(k_->shape[0]);
  shape_.heads = static_cast<int>(k_->shape[1]);
  shape_.seq_len = k_->shape[2];
  shape_.head_dim = static_cast<int>(k_->shape[3]);
  shape_.q_heads = static_cast<int>(q_window_->shape[1]);
  shape_.window = static_cast<int>(q_window_->shape[2]);
  shape_.future = static_cast<int>(q_future_->shape[2]);
  for (const TensorInfo *q : {q_window_, q_future_}) {
    if (q->shape[0] != shape_.layers || q->shape[1] != shape_.q_heads ||
        q->shape[3] != shape_.head_dim)
      throw fail("tensor \"" + q->name + "\" has shape " + shape_text(q->shape) + "; [" +
                 std::to_string(shape_.layers) + ", Hq, n, " + std::to_string(shape_.head_dim) +
                 "] expected (same L and D as k, same Hq for both query tensors)");
  }
  if (shape_.q_heads % shape_.heads != 0)
    throw fail("q heads (" + std::to_string(shape_.q_heads) + ") must be a multiple of KV heads (" +
               std::to_string(shape_.heads) + ")");
  if (shape_.window > shape_.seq_len)
    throw fail("window (" + std::to_string(shape_.window) + ") is longer than the prompt (" +
               std::to_string(shape_.seq_len) + ")");

  const auto &meta = file_.metadata();
  auto field = [&](const char *key) -> const std::string * {
    auto it = meta.find(key);
    return it == meta.end() ? nullptr : &it->second;
  };
  const std::string *style = field("rope_style");
  if (style == nullptr)
    throw fail("__metadata__ lacks rope_style (neox, gptj or none): the RoPE convention of "
               "the keys must be stated");
  if (*style == "neox")
    positions_.rope.style = AKV_ROPE_NEOX;
  else if (*style == "gptj")
    positions_.rope.style = AKV_ROPE_GPTJ;
  else if (*style == "none")
    positions_.rope.style = AKV_ROPE_NONE;
  else
    throw fail("__metadata__.rope_style \"" + *style + "\" is not neox, gptj or none");
  if (const std::string *base = field("rope_base"))
    positions_.rope.base = parse_number(*base, path + ": __metadata__.rope_base");
  if (const std::string *dim = field("rotary_dim"))
    positions_.rope.rotary_dim =
        static_cast<int>(parse_integer(*dim, path + ": __metadata__.rotary_dim"));
  if (const std::string *post = field("keys_post_rope")) {
    if (*post != "0" && *post != "1")
      throw fail("__metadata__.keys_post_rope must be \"0\" or \"1\", got \"" + *post + "\"");
    positions_.keys_post_rope = *post == "1";
  }
  if (const std::string *offset = field("position_offset"))
    positions_.position_offset = parse_integer(*offset, path + ": __metadata__.position_offset");
  if (positions_.position_offset < 0 ||
      positions_.position_offset + shape_.seq_len > (int64_t{1} << 31) - 1)
    throw fail("position_offset puts positions outside the int32 range");
  if (const std::string *scale = field("softmax_scale")) {
    positions_.softmax_scale = parse_number(*scale, path + ": __metadata__.softmax_scale");
    if (positions_.softmax_scale <= 0.0) throw fail("__metadata__.softmax_scale must be positive");
  }
  if (const TensorInfo *inv_freq = file_.find("inv_freq")) {
    if (inv_freq->dtype_name != "F32" || inv_freq->shape.size() != 1)
      throw fail("tensor \"inv_freq\" must be F32 with one dimension");
    positions_.rope.inv_freq = file_.read(*inv_freq, 0, inv_freq->elements());
  }
  if (positions_.rope.style != AKV_ROPE_NONE) {
    const int rotary_dim =
        positions_.rope.rotary_dim == 0 ? shape_.head_dim : positions_.rope.rotary_dim;
    if (rotary_dim <= 0 || rotary_dim > shape_.head_dim || rotary_dim % 2 != 0)
      throw fail("rotary_dim " + std::to_string(rotary_dim) + " must be even and within (0, " +
                 std::to_string(shape_.head_dim) + "]");
    if (!positions_.rope.inv_freq.empty() &&
        static_cast<int>(positions_.rope.inv_freq.size()) != rotary_dim / 2)
      throw fail("inv_freq has " + std::to_string(positions_.rope.inv_freq.size()) +
                 " entries; rotary_dim/2 = " + std::to_string(rotary_dim / 2) + " expected");
  }

  if (dtype_override != AKV_DTYPE_AUTO) {
    dtype_ = dtype_override;
  } else if (k_->dtype == v_->dtype && k_->dtype == q_window_->dtype) {
    dtype_ = k_->dtype == TensorDtype::F32   ? AKV_DTYPE_F32
             : k_->dtype == TensorDtype::F16 ? AKV_DTYPE_F16
                                             : AKV_DTYPE_BF16;
  } else {
    dtype_ = AKV_DTYPE_F32;  // mixed dtypes: hand everything over in fp32, losslessly
  }
}

std::string SafetensorsSource::describe() const {
  std::ostringstream text;
  text << file_.path() << " (k " << k_->dtype_name << ", rope "
       << positions_.rope.describe(shape_.head_dim)
       << (positions_.keys_post_rope ? ", keys post-RoPE" : ", keys pre-RoPE");
  if (positions_.position_offset != 0) text << ", position offset " << positions_.position_offset;
  text << ", inputs " << dtype_label(dtype_) << ")";
  return text.str();
}

LayerTensors SafetensorsSource::load(int layer) {
  const EvalShape &s = shape_;
  LayerTensors out;
  const int64_t kv_count = static_cast<int64_t>(s.heads) * s.seq_len * s.head_dim;
  out.keys = file_.read(*k_, layer * kv_count, kv_count);
  out.values = file_.read(*v_, layer * kv_count, kv_count);
  const int64_t window_count = static_cast<int64_t>(s.q_heads) * s.window * s.head_dim;
  out.q_window = file_.read(*q_window_, layer * window_count, window_count);
  const int64_t future_count = static_cast<int64_t>(s.q_heads) * s.future * s.head_dim;
  out.q_future = file_.read(*q_future_, layer * future_count, future_count);
  for (auto *tensor : {&out.keys, &out.values, &out.q_window, &out.q_future})
    round_to_dtype(*tensor, dtype_);
  return out;
}

}  // namespace akvcli
