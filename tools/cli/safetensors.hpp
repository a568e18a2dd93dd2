// A minimal safetensors reader (https://github.com/huggingface/safetensors, format section):
//   bytes 0..7   little-endian uint64 N, the header length
//   bytes 8..8+N a JSON object: {"name": {"dtype": "F32", "shape": [..],
//                "data_offsets": [begin, end]}, ..., "__metadata__": {"key": "string"}}
//   the rest     raw little-endian tensor data; offsets are relative to byte 8+N.
// Tensors are read lazily, one slice at a time, so files larger than memory work.
#pragma once

#include <cstdint>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "layer_source.hpp"

namespace akvcli {

extern const char *const kDataFormatHelp;

enum class TensorDtype { F32, F16, BF16 };

struct TensorInfo {
  std::string name;
  std::string dtype_name;            // as written in the header ("F32", "I64", ...)
  bool float_dtype = false;          // F32, F16 or BF16: readable by read()
  TensorDtype dtype = TensorDtype::F32;
  size_t item_bytes = 0;
  std::vector<int64_t> shape;
  uint64_t begin = 0, end = 0;  // byte offsets relative to the data section

  int64_t elements() const;
};

class SafetensorsFile {
 public:
  // Opens and validates the header; throws CliError naming the file and the problem.
  explicit SafetensorsFile(const std::string &path);

  const std::string &path() const { return path_; }
  const std::map<std::string, TensorInfo> &tensors() const { return tensors_; }
  const std::map<std::string, std::string> &metadata() const { return metadata_; }
  const TensorInfo *find(const std::string &name) const;

  // Reads `count` elements starting at element `first` of a tensor, converted to fp32.
  std::vector<float> read(const TensorInfo &tensor, int64_t first, int64_t count) const;

 private:
  struct FileCloser {
    void operator()(std::FILE *file) const { std::fclose(file); }
  };
  std::string path_;
  std::unique_ptr<std::FILE, FileCloser> file_;
  uint64_t data_start_ = 0, data_size_ = 0;
  std::map<std::string, TensorInfo> tensors_;
  std::map<std::string, std::string> metadata_;
};

// `anchorkv eval --data FILE`: tensors k, v [L,H,S,D], q_window [L,Hq,W,D], q_future
// [L,Hq,F,D]; optional inv_freq [rotary_dim/2]; RoPE settings in __metadata__.
class SafetensorsSource : public LayerSource {
 public:
  // dtype_override: AKV_DTYPE_AUTO keeps the file's dtype of k/v for the library inputs.
  SafetensorsSource(const std::string &path, akv_dtype dtype_override);
  SafetensorsSource(const SafetensorsSource &) = delete;  // holds pointers into file_
  SafetensorsSource &operator=(const SafetensorsSource &) = delete;

  const EvalShape &shape() const override { return shape_; }
  const PositionConfig &positions() const override { return positions_; }
  akv_dtype input_dtype() const override { return dtype_; }
  std::string describe() const override;
  LayerTensors load(int layer) override;

 private:
  SafetensorsFile file_;
  EvalShape shape_;
  PositionConfig positions_;
  akv_dtype dtype_ = AKV_DTYPE_F32;
  const TensorInfo *k_ = nullptr, *v_ = nullptr, *q_window_ = nullptr, *q_future_ = nullptr;
};

}  // namespace akvcli
